"""``plan_pipeline``: the pipeline (pp), tensor (tp) and data-parallel (dp, ddp or fsdp) degrees together.

[Note: choosing the pipeline degree]
A candidate is ``(pp, tp, dp, dp_strategy, activations)`` with ``pp x tp x dp = world``: ``pp`` a divisor of the
world with enough blocks for its stages (``pp`` stages, ``2 pp`` in a V for zbv), ``tp`` a power of
two up to ``tp_max`` that divides the units a view cuts each column Linear's output into (attention
and key/value heads, a fused projection's q/k/v parts: ``megatron_plan``, as ``dpar.pipeline`` splits), and each
of ``dp_strategies`` (fsdp only where dp > 1: with one pipeline it is ddp plus a copy), under each
activation policy (``keep``, ``selective``, ``full``, the same for every block). The
global batch is cut into micro-batches of ``micro_batch_rows`` rows; the ``tp`` ranks of a stage
share a micro-batch, so a pipeline runs ``m = rows / (dp x micro_batch_rows)`` of them. The micro-batch's rows
are one more dimension ([Note: searching the micro-batch]).

Costs come from one capture at each micro-batch's shape: the model is cut into one stage per block
and each block priced as ``dpar inspect`` prices a stage ([Note: the pipeline cost model]; the
middle blocks of a deep model share one trace). A candidate's stage of consecutive blocks
(``balanced_cuts`` over the blocks' FLOPs, as ``split_stages`` cuts) costs the sum of its blocks:
forward time, parameters and saved activations, less the values each block computes from the batch
alone (RoPE's cos and sin), held once; it sends what its last block sends. Under ``tp``,
Megatron-style with sequence parallelism:

- compute / tp: the **whole** stage's forward, not only its matrix products (a first model: the
  norms and element-wise ops are split too only with sequence parallelism, and the attention's
  softmax is split by heads);
- parameters, gradients and optimizer state / tp (the norms' weights, replicated in Megatron, too);
- activations / tp: with sequence parallelism every saved value, the norms' and residuals'
  included, is split over the tp ranks (Korthikanti et al. 2022), and so is a send between stages;
- per block and micro-batch, two collectives of the block's activation (the bytes a block hands
  on) in the forward and two in the backward (I under zb_h1 / zbv, W has none): all-reduces, or
  with sequence parallelism reduce-scatter + all-gather, the same bytes. They are priced
  ``link_time`` on the intra-node link where ``tp`` fits in a node (``DeviceSpec.links``: tp is
  the innermost mesh dimension), added to the actions' time (not overlapped with compute).
  Given ``read_tp_collectives`` (``dpar plan --pipeline`` hands down ``dpar.inspect.pipeline.block_collectives``),
  the collectives are instead the ones the stage graphs ``dpar.pipeline`` builds hold, read per block at tp 2
  (``BlockCollectives``: their count and bytes do not depend on the degree), priced the same way. On a Llama
  layer that is 2 all-reduces in F and 6 in B (4 of activations' gradients, 2 of its norms' weights), where the
  model above says 2 and 2; read block by block, a stage of several blocks is counted 2 reductions high at each
  boundary an input gradient crosses inside it (its graph reduces the two blocks' partial sums together).

``schedule`` names one of ``PLANNED_SCHEDULES`` or several, each then one more dimension of the candidates
(``dpar.plan`` searches ``SEARCHED_SCHEDULES``: 1F1B and the zero-bubble ZB-H1 and ZBV; GPipe takes 1F1B's time
with more memory). Every candidate's schedule is replayed with those costs (``simulate``). Its modelled step:

    step = pipeline span (compute + tp collectives + bubble + sends on the critical path)
         + dp collectives of the fullest rank's stages (after the span, not overlapped)

with ddp's all-reduce of the rank's gradients (/ tp) over dp, or fsdp's all-gather + reduce-scatter
of them (the parameters gathered once per step and the gradients reduced once, as ``dpar.pipeline``
does under ``dp_strategy="fsdp"``: the same bytes as ddp's all-reduce in the ring model). dp and
pipeline sends use the inter-node link, even where a group would fit in a node. Reported beside
its parts: ``compute_s`` (the busiest rank's m x (F + B), tp collectives included, also shown
alone as ``tp_s``), the schedule's bubble formula and ``bubble_s = compute_s x b / (1 - b)``
(equal stages, free sends: span = compute_s + bubble_s exactly), one send's time.

Memory per rank, over its stages: parameters, gradients and optimizer state in the parameters'
dtype, / tp, and under fsdp / dp plus the gathered parameters and their unreduced gradients
(/ tp) held through the step; plus the activations of the micro-batches each stage holds at once
(1F1B: ``p - r`` on rank ``r``; GPipe: all ``m``; ZB-H1: ``p``; zbv: the simulator's count for
each of the rank's two chunks, summed), / tp. The largest rank's
is checked against the budget. The fastest candidate that fits wins; ties go to the smaller pp,
then the smaller tp, then ddp, then the policy that recomputes less.

Under a budget, a layout is priced recomputing only where that could win: where keeping everything does
not fit under every dp strategy, and no candidate priced before fits in less time than keeping everything
takes there (recomputing only adds time). An activation policy is priced as ``dpar.pipeline`` runs it: each block is traced under it
(``trace_stage``'s recomputing cut), so a stage saves what its forward then returns for the backward
and its B, I and W also cost the forward ops they compute again ([Note: the pipeline cost model]).

[Note: searching the micro-batch]
Without ``micro_batch_rows``, the micro-batch is searched from one rank's share of the batch (``rows / world``,
the largest every layout's pipelines can each take whole) down, halving while it is even, then one row: each size
is captured and priced as above, and every layout is a candidate at each. A smaller micro-batch means more of
them: a smaller bubble and fewer activations held, against more tp collectives and sends (their latency) and,
where an op is bound by reading its weights, more reads. Each node's FLOPs and bytes are affine in the rows with
an intercept of zero or more (weights, constants), so at ``r' < r`` rows each node costs at least ``r' / r`` of
its cost at ``r``, and so does each tp collective: a layout's busiest rank computes at least as long over its
``m r / r'`` micro-batches as over its ``m``. The next size is captured only where some layout's busiest rank's
compute plus its dp collectives (which no schedule undercuts: ``_Unit.least_s``) is below the fastest step found
that fits; without a budget a model with no bubble to shrink is captured once. ``bounded=True`` (``dpar.plan``)
also replays a size's layouts least bound first and stops where the bound reaches that step: the exhaustive
search's choice, with fewer schedules replayed (``unreplayed``).

Not modelled: the vocabulary-parallel embedding and loss, overlap of
the tp, dp or send collectives with compute, a dp or pp group that fits in one node (NVLink),
mixed precision (state is the model's own dtype: 4 bytes a parameter per tensor in fp32, 2 in bf16),
and a tp group larger than a node beyond pricing it on the inter-node link.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from dpar.compiler.costs import DeviceSpec, comm_time, device_spec
from dpar.compiler.megatron import MegatronPlan, megatron_plan
from dpar.compiler.memory import OPTIMIZER_STATES
from dpar.compiler.pipeline_parallel.costs import (
    BlockCollectives, LossFn, StageCost, TensorParallelCost, action_cost, cut_and_price_under, megatron_collectives,
    micro_batch_of, parameter_sizes, tensor_parallel_cost, with_loss,
)
from dpar.compiler.pipeline_parallel.schedules import (
    ZERO_BUBBLE, bubble_formula, build_schedule, execution_order, stage_placement, stages_per_rank,
)
from dpar.compiler.pipeline_parallel.simulate import SimulatedTimeline, simulate
from dpar.compiler.pipeline_parallel.split import balanced_cuts, capture, find_blocks, split_stages
from dpar.core.errors import OptionsError, PipelineMemoryError
from dpar.core.pipeline_program import Action, Op, PipelineSchedule
from dpar.core.plan import ActivationPolicy, Recompute
from dpar.core.torch_internals import no_stack_traces
from dpar.planner.capture import FIRST_BLOCKS, alike_blocks, block_index, moved, parity_source
from dpar.planner.plan import PipelineLayout
from dpar.surgery.blocks import with_blocks

PLANNED_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zbv")
"""One stage per rank, or zbv's two in a V; interleaved_1f1b's virtual stages are not searched."""

SEARCHED_SCHEDULES = ("1f1b", "zb_h1", "zbv")
"""What ``dpar.plan`` searches beside placements (see [Note: one answer over placements and pipelines])."""

DP_STRATEGIES = ("ddp", "fsdp")

ACTIVATION_POLICIES = (Recompute.KEEP, Recompute.SELECTIVE, Recompute.FULL)
"""Searched for every block at once, least recomputation first."""
_RECOMPUTES_LESS = {r.value: i for i, r in enumerate(ACTIVATION_POLICIES)}  # a candidate's policy -> its rank


@dataclasses.dataclass(frozen=True)
class PipelineCandidate:
    """One (pp, tp, dp, dp_strategy) and what it costs per step on one rank; see [Note: choosing the pipeline degree]."""

    pp: int
    tp: int
    dp: int
    dp_strategy: str
    micro_batches: int
    micro_batch_rows: int
    compute_s: float  # the busiest rank's compute, its tp collectives included
    tp_s: float  # of which the tp collectives
    bubble: float  # the schedule's formula
    bubble_s: float
    send_s: float  # one boundary's send per micro-batch (the largest)
    pipeline_s: float  # the simulated span
    dp_comm_s: float  # ddp's all-reduce or fsdp's all-gather + reduce-scatter
    step_s: float
    state_bytes: int  # the fullest rank's parameters + gradients + optimizer state (+ fsdp's gathered ones)
    activation_bytes: int  # the fullest rank's activations held at its peak
    fits: bool
    activations: str = "keep"  # the activation policy of every block
    recompute_s: float = 0.0  # of compute_s, the forward ops the busiest rank's backwards compute again
    schedule: str = "1f1b"

    @property
    def memory_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes

    @property
    def layout(self) -> str:
        schedule = "" if self.schedule == "1f1b" else f", {self.schedule}"
        policy = "" if self.activations == "keep" else f", {self.activations} recomputation"
        return f"pp={self.pp} x tp={self.tp} x dp={self.dp} ({self.dp_strategy}{schedule}{policy})"


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    world_size: int
    schedules: tuple[str, ...]  # searched
    micro_batch_sizes: tuple[int, ...]  # the micro-batch rows searched, largest first
    memory_budget_bytes: float | None
    device: str
    optimizer: str
    candidates: tuple[PipelineCandidate, ...]
    choice: PipelineCandidate
    tp_read_off_graphs: bool  # tp collectives counted in graphs dpar.pipeline built, else the Megatron model
    unreplayed: int = 0  # layouts whose bound ruled them out before their schedule was replayed (``bounded``)
    block_parameters: tuple[tuple[str, ...], ...] = ()  # what each block's stage reads (the first and last: the root's too)
    block_flops: tuple[float, ...] = ()  # each block's forward, which the stage cuts balance
    tp_dims: tuple[tuple[str, int | None], ...] = ()  # parameter -> the dim tp splits (None: replicated), Megatron's

    def stages_of(self, stages: int) -> dict[str, tuple[int, ...]]:
        """Parameter -> the stages reading it when the blocks are cut into ``stages`` (a tied one: two)."""
        starts = [*balanced_cuts(list(self.block_flops), stages), len(self.block_flops)]
        found: dict[str, tuple[int, ...]] = {}
        for stage in range(stages):
            for names in self.block_parameters[starts[stage]:starts[stage + 1]]:
                for name in names:
                    if stage not in found.get(name, ()):
                        found[name] = (*found.get(name, ()), stage)
        return found

    @property
    def schedule(self) -> str:
        return self.choice.schedule

    @property
    def micro_batch_rows(self) -> int:
        return self.choice.micro_batch_rows

    @property
    def pp(self) -> int:
        return self.choice.pp

    @property
    def tp(self) -> int:
        return self.choice.tp

    @property
    def dp(self) -> int:
        return self.choice.dp

    @property
    def dp_strategy(self) -> str:
        return self.choice.dp_strategy

    def __str__(self) -> str:
        budget = "no memory budget" if self.memory_budget_bytes is None else f"{self.memory_budget_bytes / 1e9:g} GB per rank"
        lines = [
            f"pipeline plan: {self.choice.layout} on {self.world_size} ranks ({self.schedule}, micro-batches of "
            f"{self.micro_batch_rows} rows of {'/'.join(map(str, self.micro_batch_sizes))} searched, {budget}, "
            f"{self.device}, {self.optimizer})",
            f"{'pp':>3} {'tp':>3} {'dp':>4} {'dp by':>5} {'schedule':>8} {'rows':>4} {'m':>4} {'compute':>11} "
            f"{'of it tp':>11} "
            f"{'bubble':>17} "
            f"{'send':>10} {'span':>11} {'dp comm':>11} {'step':>11} {'state GB':>9} {'act. GB':>9} "
            f"{'activations':>11} {'recompute':>11} fits",
        ]
        for c in self.candidates:
            mark = " <- chosen" if c is self.choice else ""
            lines.append(
                f"{c.pp:>3} {c.tp:>3} {c.dp:>4} {c.dp_strategy:>5} {c.schedule:>8} {c.micro_batch_rows:>4} "
                f"{c.micro_batches:>4} "
                f"{_ms(c.compute_s)} {_ms(c.tp_s)} "
                f"{c.bubble:>5.1%} {_ms(c.bubble_s)} {_ms(c.send_s, 10)} {_ms(c.pipeline_s)} {_ms(c.dp_comm_s)} "
                f"{_ms(c.step_s)} {c.state_bytes / 1e9:>9.4f} {c.activation_bytes / 1e9:>9.4f} "
                f"{c.activations:>11} {_ms(c.recompute_s)} {'yes' if c.fits else 'no'}{mark}"
            )
        if self.unreplayed:
            lines.append(f"{self.unreplayed} more layouts not replayed: their busiest rank's compute and dp "
                         "collectives alone step slower than the choice")
        if self.how_to_run:
            lines.append(f"note: {self.how_to_run}")
        return "\n".join(lines)

    @property
    def how_to_run(self) -> str:
        """The ``dpar.pipeline`` call the choice needs (mesh, dp_strategy, policy); "" for data parallel alone."""
        if self.tp > 1:
            how = (f"run it with dpar.pipeline over a ('dp', 'pp', 'tp') mesh of shape ({self.dp}, {self.pp}, {self.tp}), "
                   f"dp_strategy={self.dp_strategy!r}{self._options}; ")
            if self.tp_read_off_graphs:
                return how + "its tp collectives are those of the stage graphs dpar.pipeline builds (per block, read at tp 2)"
            return how + "tp is priced as Megatron with sequence parallel, a model not yet checked against measured runs"
        if self.pp > 1 or self.choice.activations != "keep":
            return (f"run it with dpar.pipeline over a ('dp', 'pp') mesh of shape ({self.dp}, {self.pp}), "
                    f"dp_strategy={self.dp_strategy!r}{self._options}")
        return ""

    @property
    def _options(self) -> str:
        policy, schedule = self.choice.activations, self.choice.schedule
        return ("" if schedule == "1f1b" else f", schedule={schedule!r}, stages={self.pp * stages_per_rank(schedule)}") \
            + ("" if policy == "keep" else f", activation_checkpointing={policy!r}")


def _ms(seconds: float, width: int = 11) -> str:
    return f"{seconds * 1e3:.4f} ms".rjust(width)


def plan_pipeline(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    world_size: int,
    memory_budget_gb: float | None,
    micro_batch_rows: int | None = None,
    schedule: str | Sequence[str] = "1f1b",
    loss_fn: LossFn | None = None,
    device: str | DeviceSpec = "h100",
    optimizer: str = "adamw",
    tp_max: int = 8,
    dp_strategies: Sequence[str] = DP_STRATEGIES,
    read_tp_collectives: Callable[[str, Sequence[torch.Tensor], LossFn], BlockCollectives] | None = None,
    min_pp: int = 1,
    bounded: bool = False,
) -> PipelinePlan:
    """The (pp, tp, dp, dp strategy, micro-batch rows) with the least modelled step that fits the budget.

    ``example_inputs`` is the **global** batch, as ``dpar.plan`` takes it (``loss_fn`` and the
    target as in ``dpar.explain(strategy="pipeline")``: with a loss the last input is the target,
    without one next-token cross-entropy is priced). ``micro_batch_rows``: the micro-batch's rows; by default
    searched from one rank's share of the batch (``rows / world_size``) down ([Note: searching the micro-batch]).
    ``tp_max=1`` and ``dp_strategies=("ddp",)`` search pp alone, what ``dpar.pipeline`` runs today. ``min_pp=2``
    searches pipelines of two stages or more only. ``bounded``: replay only the layouts that could beat the best
    found (the same choice; the table lists fewer rows). Raises ``PipelineMemoryError`` when nothing fits.
    ``read_tp_collectives(prefix, micro_batch, loss)`` (``dpar.inspect.pipeline.block_collectives`` with
    ``dpar.pipeline``, which the api hands down) gives each block's tp collectives as the pipeline's graphs hold
    them; without it they are modelled as Megatron's (two per block in F and in B).
    """
    schedules = (schedule,) if isinstance(schedule, str) else tuple(schedule)
    unplanned = [name for name in schedules if name not in PLANNED_SCHEDULES]
    if unplanned or not schedules:
        raise OptionsError(f"plan_pipeline: schedule {unplanned or schedule!r} is not one of {list(PLANNED_SCHEDULES)} "
                           "(one stage per rank, or zbv's V); plan with '1f1b' and inspect the interleaved schedule "
                           "with dpar.explain")
    if optimizer not in OPTIMIZER_STATES:
        raise OptionsError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise OptionsError(f"plan_pipeline: world_size must be a positive int, got {world_size!r}")
    if not isinstance(tp_max, int) or tp_max < 1:
        raise OptionsError(f"plan_pipeline: tp_max must be a positive int, got {tp_max!r}; 1 searches no tensor parallelism")
    unknown = [s for s in dp_strategies if s not in DP_STRATEGIES]
    if unknown or not dp_strategies:
        raise OptionsError(f"plan_pipeline: dp_strategies {list(dp_strategies)} must be some of {list(DP_STRATEGIES)}")
    inputs, loss = with_loss(example_inputs, loss_fn)
    rows = inputs[0].shape[0]
    largest = micro_batch_rows or rows // world_size
    if largest < 1 or rows % largest:
        raise OptionsError(f"plan_pipeline: micro_batch_rows={micro_batch_rows} does not divide the global batch of "
                           f"{rows} rows; use a divisor of {rows} (default: rows / world_size, {rows // world_size})")
    spec = device_spec(device).sharing_cores(world_size)  # the placement search's links for the same world
    forward_inputs = micro_batch_of(inputs, largest)[:-1]
    megatron = _megatron_from_first_blocks(model, forward_inputs) or megatron_plan(model, forward_inputs)
    divides = _tp_must_divide(megatron)
    tp_degrees = [tp for tp in (2 ** k for k in range(tp_max.bit_length()) if 2 ** k <= tp_max)
                  if world_size % tp == 0 and not any(size % tp for size in divides.values())]
    # Read only where a tp degree is searched: the pipeline refuses tp 2 where it does not divide the units.
    read = read_tp_collectives if max(tp_degrees) > 1 else None
    candidates: list[PipelineCandidate] = []
    priced_at: dict[int, _BlockPrices] = {}
    unreplayed, blocks = 0, 0
    for size in (largest,) if micro_batch_rows else micro_batch_sizes(largest):
        if candidates and not _smaller_could_win(candidates, units):
            break
        prices = priced_at[size] = _price_blocks(model, inputs, loss, size, spec, read)
        blocks = len(prices.per_block[Recompute.KEEP])
        units = _units(prices, model, schedules, range(min_pp, blocks + 1), tp_degrees, world_size, rows,
                       dp_strategies, spec)
        unreplayed += _replay(units, candidates, dp_strategies, spec, optimizer, memory_budget_gb, bounded)
    candidates = _worth_recomputing(candidates)
    if not candidates:
        raise OptionsError(
            f"plan_pipeline: no pp x tp x dp = {world_size} (pp {min_pp} or more, tp up to {tp_max} dividing "
            f"{_sizes(divides)}, {max(stages_per_rank(name) for name in schedules)} stage(s) per rank over {blocks} "
            f"blocks) splits the batch of {rows} rows into micro-batches of "
            f"{largest} per pipeline; use a batch that is a multiple of world_size x micro_batch_rows"
        )
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_bytes)
        raise PipelineMemoryError(
            f"plan_pipeline: no layout fits {memory_budget_gb:g} GB per rank; the least memory is {least.layout} "
            f"with {least.memory_bytes / 1e9:.4g} GB ({least.state_bytes / 1e9:.4g} GB parameters, gradients and "
            f"optimizer state, {least.activation_bytes / 1e9:.4g} GB activations). Raise memory_budget_gb to at least "
            f"{least.memory_bytes / 1e9:.4g}, or cut the activations (smaller micro_batch_rows, shorter sequences) "
            f"or the state (more ranks, a larger tp_max, dp_strategy "
            f"fsdp, an optimizer with less state)"
        )
    choice = fastest(fitting)
    keep = priced_at[choice.micro_batch_rows].per_block[Recompute.KEEP]  # its stage cuts balance these flops
    return PipelinePlan(
        world_size=world_size, schedules=schedules, micro_batch_sizes=tuple(priced_at),
        memory_budget_bytes=None if memory_budget_gb is None else memory_budget_gb * 1e9,
        device=spec.name, optimizer=optimizer, candidates=tuple(candidates), choice=choice,
        tp_read_off_graphs=read is not None, unreplayed=unreplayed,
        block_parameters=tuple(c.parameters for c in keep), block_flops=tuple(c.flops for c in keep),
        tp_dims=tuple(megatron.dims.items()),
    )


def micro_batch_sizes(largest: int) -> tuple[int, ...]:
    """The micro-batch rows searched from ``largest`` down: halved while it is even, then one row. Each divides
    ``largest``, so every layout's pipelines take whole micro-batches of each."""
    sizes = [largest]
    while sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes) if sizes[-1] == 1 else (*sizes, 1)


@dataclasses.dataclass(frozen=True)
class _BlockPrices:
    """Every block priced as a stage of its own under each activation policy, at micro-batches of ``rows``."""

    rows: int
    per_block: dict[Recompute, tuple[StageCost, ...]]
    block_bytes: int  # the largest activation a block hands on
    read: BlockCollectives | None  # tp's collectives off the stage graphs, or None: Megatron's model


def _price_blocks(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss: LossFn, rows: int, spec: DeviceSpec,
                  read_tp_collectives: Callable[[str, Sequence[torch.Tensor], LossFn], BlockCollectives] | None,
                  ) -> _BlockPrices:
    micro_batch = micro_batch_of(inputs, rows)
    policies = [ActivationPolicy(r) for r in ACTIVATION_POLICIES]
    found = _priced_from_first_blocks(model, micro_batch, loss, spec, policies)
    if found is None:
        with no_stack_traces():  # a fifth of the export's time, and the search reads none
            graph = capture(model, loss, micro_batch)
        prefix, blocks = find_blocks(graph)
        split = split_stages(graph, model, len(blocks))
        found = prefix, cut_and_price_under(split, model, micro_batch, spec, policies)
    prefix, priced = found
    per_block = {policy.default: costs for policy, costs in priced.items()}
    return _BlockPrices(
        rows=rows, per_block=per_block,
        block_bytes=max((c.send_bytes for c in per_block[Recompute.KEEP]), default=0),
        read=None if read_tp_collectives is None else read_tp_collectives(prefix, micro_batch, loss))


def _priced_from_first_blocks(model: nn.Module, micro_batch: Sequence[torch.Tensor], loss: LossFn, spec: DeviceSpec,
                              policies: list[ActivationPolicy]) -> tuple[str, dict[ActivationPolicy, tuple[StageCost, ...]]] | None:
    """(the blocks' prefix, each block priced as a stage of its own under each policy) from a capture of the model's
    first blocks, each block after them priced as the last kept block of its parity but the last, priced as the
    kept last (which holds what follows the blocks); None where the model is not many alike blocks, its first blocks
    will not run alone, or the two kept middle blocks price otherwise ([Note: a capture of the first blocks] in
    capture.py: the op graph's counterpart)."""
    found = alike_blocks(model)
    if found is None:
        return None
    path, total = found
    first = with_blocks(model, path, range(FIRST_BLOCKS))
    try:
        with no_stack_traces():
            graph = capture(first, loss, micro_batch)
        prefix, blocks = find_blocks(graph)
        priced = cut_and_price_under(split_stages(graph, first, FIRST_BLOCKS), first, micro_batch, spec, policies)
    except Exception:  # noqa: BLE001 - a forward that runs only its whole block list: the whole capture says what it says
        return None
    if blocks != list(range(FIRST_BLOCKS)):
        return None

    def as_block(cost: StageCost, source: int, k: int) -> StageCost:
        return dataclasses.replace(cost, index=k, blocks=tuple(moved(b, f"{path}.{source}", f"{path}.{k}") for b in cost.blocks),
                                   parameters=tuple(moved(p, f"{path}.{source}", f"{path}.{k}") for p in cost.parameters))

    whole = {}
    for policy, costs in priced.items():
        if as_block(costs[2], 2, 1) != costs[1]:
            return None
        whole[policy] = (costs[0], *(as_block(costs[2 - k % 2], 2 - k % 2, k) for k in range(1, total - 1)),
                         as_block(costs[-1], FIRST_BLOCKS - 1, total - 1))
    return prefix, whole


def _megatron_from_first_blocks(model: nn.Module, inputs: Sequence[torch.Tensor]) -> MegatronPlan | None:
    """``megatron_plan`` of the model, from a forward of its first blocks where it is many alike blocks: each block
    after them split as the last kept block of its parity, in the whole forward's order; None (the whole forward
    answers) where the kept blocks split otherwise, or will not run alone (Llama-3-405B's whole forward on fake
    tensors: 3.4-4.9 s)."""
    found = alike_blocks(model)
    if found is None:
        return None
    path, total = found
    try:
        cut = megatron_plan(with_blocks(model, path, range(FIRST_BLOCKS)), inputs)
    except Exception:  # noqa: BLE001 - a forward that runs only its whole block list: the whole forward answers
        return None

    def relative(table: dict[str, object], k: int) -> list[tuple[str, object]]:
        return [(moved(name, f"{path}.{k}", ""), v) for name, v in table.items() if block_index(name, path) == k]

    if not relative(cut.dims, 1) == relative(cut.dims, 2) == relative(cut.dims, 3) \
            or not relative(cut.units, 1) == relative(cut.units, 2) == relative(cut.units, 3):
        return None
    blocks_seen, before, after = False, [], []
    for name, v in cut.units.items():  # the whole forward's order: before the blocks, block after block, after them
        if block_index(name, path) is not None:
            if after:  # a Linear outside the blocks between two in them
                return None
            blocks_seen = True
        else:
            (after if blocks_seen else before).append((name, v))

    def source(k: int) -> int:
        return k if k < FIRST_BLOCKS else parity_source(k)

    units = dict(before)
    for k in range(total):
        units.update((f"{path}.{k}{name}", v) for name, v in relative(cut.units, source(k)))
    units.update(after)
    dims = {}
    for name, _ in model.named_parameters():
        k = block_index(name, path)
        dims[name] = cut.dims[name if k is None else moved(name, f"{path}.{k}", f"{path}.{source(k)}")]
    return MegatronPlan(dims, units)


@dataclasses.dataclass(frozen=True)
class _Unit:
    """One layout under one activation policy at one micro-batch size, before its schedule is replayed."""

    schedule: str
    pp: int
    tp: int
    dp: int
    micro_batches: int
    rows: int
    policy: Recompute
    costs: tuple[StageCost, ...]
    tp_cost: TensorParallelCost
    latency: float
    least_s: float  # its busiest rank's compute plus its least dp comm: no dp strategy steps faster


def _units(prices: _BlockPrices, model: nn.Module, schedules: Sequence[str], pps: range, tp_degrees: Sequence[int],
           world_size: int, rows: int, dp_strategies: Sequence[str], spec: DeviceSpec) -> list[_Unit]:
    """Every layout the micro-batch of ``prices.rows`` allows, in the order the table lists them."""
    units, staged_by_count = [], {}
    for name in schedules:
        for pp in pps:
            stages = pp * stages_per_rank(name)
            if world_size % pp or stages > len(prices.per_block[Recompute.KEEP]):
                continue
            staged = staged_by_count.setdefault(stages, {
                policy: _stages(prices.per_block[policy], stages, model) for policy in ACTIVATION_POLICIES})
            on_rank = [[s for s, r in enumerate(stage_placement(name, pp, stages)) if r == rank] for rank in range(pp)]
            for tp in tp_degrees:
                if world_size % (pp * tp) or rows % (world_size // (pp * tp) * prices.rows):
                    continue  # the dp pipelines cannot each take whole micro-batches
                dp = world_size // (pp * tp)
                m = rows // (dp * prices.rows)
                keep = staged[Recompute.KEEP]
                collectives = megatron_collectives(keep, prices.block_bytes) if prices.read is None \
                    else prices.read.of_stages([len(c.blocks) for c in keep])
                tp_cost = tensor_parallel_cost(collectives, tp, spec, read_off_graphs=prices.read is not None)
                dp_comm = min(_dp_comm_s(keep, on_rank, tp, dp, strategy, spec)
                              for strategy in dp_strategies if strategy == "ddp" or dp > 1)
                for policy, costs in staged.items():
                    cost = action_cost(costs, tp_cost)
                    ops = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if name in ZERO_BUBBLE \
                        else (Op.FORWARD, Op.BACKWARD)
                    busiest = max(m * sum(cost(Action(op, s, 0)) for s in mine for op in ops) for mine in on_rank)
                    units.append(_Unit(
                        schedule=name, pp=pp, tp=tp, dp=dp, micro_batches=m, rows=prices.rows, policy=policy,
                        costs=costs, tp_cost=tp_cost, least_s=busiest + dp_comm,
                        latency=max((spec.alpha + c.send_bytes / tp * spec.beta for c in costs if c.send_bytes),
                                    default=0.0)))
    return units


_ROUNDING = 1e-9
"""Relative slack on a bound compared with a replayed step (the two sum the same terms in different orders)."""


def _replay(units: Sequence[_Unit], candidates: list[PipelineCandidate], dp_strategies: Sequence[str],
            spec: DeviceSpec, optimizer: str, memory_budget_gb: float | None, bounded: bool) -> int:
    """Replay each unit's schedule and price it into ``candidates``; ``bounded``: least bound first, stopping where
    none left could beat the fastest that fits. Returns how many were not replayed."""
    order = sorted(range(len(units)), key=lambda i: units[i].least_s) if bounded else range(len(units))
    kept: dict[tuple, list[PipelineCandidate]] = {}  # each layout's candidates keeping every activation
    schedules: dict[tuple[str, int, int], tuple[PipelineSchedule, tuple]] = {}
    for done, i in enumerate(order):
        unit = units[i]
        best = _fastest_fitting_s(candidates)
        if bounded and unit.least_s > best * (1 + _ROUNDING):
            return len(units) - done
        layout = (unit.schedule, unit.pp, unit.tp, unit.micro_batches)
        if unit.policy is not Recompute.KEEP and memory_budget_gb is not None and _cannot_win(kept[layout], candidates):
            continue
        if (unit.schedule, unit.pp, unit.micro_batches) not in schedules:
            plan = build_schedule(unit.schedule, num_ranks=unit.pp, micro_batches=unit.micro_batches, checked=False)
            schedules[unit.schedule, unit.pp, unit.micro_batches] = plan, execution_order(plan)  # checks it
        plan, executed = schedules[unit.schedule, unit.pp, unit.micro_batches]
        timeline = simulate(plan, action_cost(unit.costs, unit.tp_cost), latency=unit.latency, order=executed)
        priced = [_price(plan, timeline, unit, strategy, spec, optimizer, memory_budget_gb)
                  for strategy in dp_strategies if strategy == "ddp" or unit.dp > 1]  # fsdp of one: ddp + a copy
        kept.setdefault(layout, priced)
        candidates.extend(priced)
    return 0


def _smaller_could_win(candidates: Sequence[PipelineCandidate], units: Sequence[_Unit]) -> bool:
    """Whether a smaller micro-batch could step faster than the fastest that fits: only where some layout's
    bound at this size is below it (see [Note: searching the micro-batch])."""
    best = _fastest_fitting_s(candidates)
    return any(unit.least_s < best * (1 - _ROUNDING) for unit in units)


def layout_of(candidate: PipelineCandidate) -> PipelineLayout:
    """What ``dpar.pipeline(plan=...)`` runs for ``candidate``."""
    return PipelineLayout(
        pp=candidate.pp, tp=candidate.tp, dp=candidate.dp, dp_strategy=candidate.dp_strategy,
        schedule=candidate.schedule, stages=candidate.pp * stages_per_rank(candidate.schedule),
        micro_batches=candidate.micro_batches, micro_batch_rows=candidate.micro_batch_rows)


def fastest(candidates: Sequence[PipelineCandidate]) -> PipelineCandidate:
    """The least modelled step; ties go to the smaller pp, then the smaller tp, then the schedule first in
    ``PLANNED_SCHEDULES``, then ddp, then less recomputation."""
    return min(candidates, key=lambda c: (c.step_s, c.pp, c.tp, PLANNED_SCHEDULES.index(c.schedule),
                                          DP_STRATEGIES.index(c.dp_strategy), _RECOMPUTES_LESS[c.activations]))


def _fastest_fitting_s(candidates: Sequence[PipelineCandidate]) -> float:
    """The least step of the candidates that fit (infinite where none does)."""
    return min((c.step_s for c in candidates if c.fits), default=float("inf"))


def _cannot_win(kept: list[PipelineCandidate], found: list[PipelineCandidate]) -> bool:
    """Whether recomputing on the layout of ``kept`` (its candidates keeping everything) is only slower: each
    fits already, or a candidate found before fits in less time than any of them (recomputing adds time)."""
    fastest = _fastest_fitting_s(found)
    return all(c.fits for c in kept) or fastest <= min(c.step_s for c in kept)


def _worth_recomputing(candidates: list[PipelineCandidate]) -> list[PipelineCandidate]:
    """Every candidate keeping activations, and one recomputing only where it holds less memory than each
    policy recomputing less on the same layout and micro-batch (a stack of Linears saves the same under every
    policy)."""
    held: dict[tuple, list[int]] = {}
    kept = []
    for c in sorted(candidates, key=lambda c: _RECOMPUTES_LESS[c.activations]):
        before = held.setdefault((c.pp, c.tp, c.dp, c.dp_strategy, c.schedule, c.micro_batch_rows), [])
        if all(c.memory_bytes < m for m in before):
            kept.append(c)
        before.append(c.memory_bytes)
    order = {id(c): i for i, c in enumerate(candidates)}
    return sorted(kept, key=lambda c: order[id(c)])


def _stages(per_block: Sequence[StageCost], stages: int, model: nn.Module) -> tuple[StageCost, ...]:
    """``stages`` stages of consecutive blocks, each the sum of its blocks' costs (see the Note)."""
    starts = [*balanced_cuts([c.flops for c in per_block], stages), len(per_block)]
    parameters = dict(model.named_parameters(remove_duplicate=False))
    merged = []
    for s in range(stages):
        run = per_block[starts[s]:starts[s + 1]]
        names = tuple(sorted({n for c in run for n in c.parameters}))
        numel, nbytes = parameter_sizes(parameters, names)
        free = max(c.free_activation_bytes for c in run)
        merged.append(StageCost(
            index=s, blocks=tuple(b for c in run for b in c.blocks), parameters=names,
            parameter_numel=numel, parameter_bytes=nbytes,
            flops=sum(c.flops for c in run), forward_s=sum(c.forward_s for c in run),
            activation_bytes=sum(c.activation_bytes - c.free_activation_bytes for c in run) + free,
            free_activation_bytes=free, send_bytes=run[-1].send_bytes, send_s=run[-1].send_s,
            recompute_s=sum(c.recompute_s for c in run), recompute_input_s=sum(c.recompute_input_s for c in run),
        ))
    return tuple(merged)


def _tp_must_divide(megatron: MegatronPlan) -> dict[str, int]:
    """What tp must divide: the units (attention heads, a fused projection's q/k/v parts) a view cuts each
    column Linear's output into, as ``dpar.pipeline``'s tp split reads them (``megatron_plan``), so that the
    planner proposes no tp degree the pipeline refuses. One entry per distinct count."""
    by_count: dict[int, list[str]] = {}
    for name, count in megatron.units.items():
        by_count.setdefault(count, []).append(name)
    return {(f"units of {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")): count
            for count, names in sorted(by_count.items())}


def _sizes(divides: dict[str, int]) -> str:
    return ", ".join(f"{size} {what}" for what, size in divides.items()) or "anything"


def _dp_comm_s(costs: Sequence[StageCost], on_rank: Sequence[Sequence[int]], tp: int, dp: int, strategy: str,
               spec: DeviceSpec) -> float:
    """The fullest rank's dp collectives: ddp's all-reduce of its gradients (/ tp), or fsdp's all-gather and
    reduce-scatter of them."""
    kinds = ("all_gather", "reduce_scatter") if strategy == "fsdp" else ("all_reduce",)
    return max(sum(comm_time(kind, sum(costs[s].parameter_bytes for s in stages) / tp, dp, spec) for kind in kinds)
               for stages in on_rank)


def _price(plan: PipelineSchedule, timeline: SimulatedTimeline, unit: _Unit, strategy: str, spec: DeviceSpec,
           optimizer: str, memory_budget_gb: float | None) -> PipelineCandidate:
    pp, m, fsdp, tp, dp, costs = plan.num_ranks, plan.micro_batches, strategy == "fsdp", unit.tp, unit.dp, unit.costs
    compute = max(timeline.busy)
    b = bubble_formula(plan.name, pp, m)
    state, activations = [], []
    for rank in range(pp):
        stages = plan.stages_of(rank)
        params = sum(costs[s].parameter_bytes for s in stages) / tp
        factor = 2 + OPTIMIZER_STATES[optimizer]
        state.append(params * factor / dp + 2 * params if fsdp else params * factor)
        activations.append(sum(timeline.peak_in_flight[s] * costs[s].activation_bytes for s in stages) / tp)
    dp_comm = _dp_comm_s(costs, [plan.stages_of(rank) for rank in range(pp)], tp, dp, strategy, spec)
    fullest = max(range(pp), key=lambda r: state[r] + activations[r])
    busiest = max(range(pp), key=lambda r: timeline.busy[r])
    memory = state[fullest] + activations[fullest]
    tp_seconds = unit.tp_cost.seconds
    return PipelineCandidate(
        pp=pp, tp=tp, dp=dp, dp_strategy=strategy, micro_batches=m, micro_batch_rows=unit.rows, compute_s=compute,
        tp_s=m * sum(tp_seconds[s][Op.FORWARD] + tp_seconds[s][Op.BACKWARD] for s in plan.stages_of(busiest)),
        bubble=b, bubble_s=compute * b / (1 - b),
        send_s=unit.latency, pipeline_s=timeline.span, dp_comm_s=dp_comm, step_s=timeline.span + dp_comm,
        state_bytes=round(state[fullest]), activation_bytes=round(activations[fullest]),
        fits=memory_budget_gb is None or memory <= memory_budget_gb * 1e9,
        activations=unit.policy.value, recompute_s=m * sum(costs[s].recompute_s for s in plan.stages_of(busiest)) / tp,
        schedule=plan.name,
    )
