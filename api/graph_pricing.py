"""A chosen plan priced on the graphs dpar compiles for it: ``dpar.plan(on_graphs=True)``, ``dpar plan``'s default.

[Note: the planner searches on its op graph and reports as inspect]
The search prices every layout and candidate per op (planner/costs.py): fast, and good enough to rank plans.
The plan it chooses is then, with ``on_graphs``, priced by ``dpar.explain`` on the plan itself: the step dpar
compiles for each rank of the mesh (a fake world), with its collectives, joint passes and partitioner, on a
meta copy of the model (nothing computed, the user's model untouched). Compute and recomputation are the
graphs' node costs, the step is the simulated streams', memory is the state a rank holds plus the live bytes
at the step's peak (gathered parameters and activations, ``Memory.total``): the figures ``dpar inspect``
prints for the same model, plan and device, to the byte and the nanosecond, because they are its figures. A
plan that recomputes is priced again keeping every activation, for the before/after table. The search's
op-graph figures differ where the graphs do (the min-cut partitioner recomputes pointwise ops the op graph
counts as saved; Hugging Face's GQA copies K and V under torch.compile only); the tp/dp split of the
communication stays the search's, which the report does not keep. A plan with a tensor- or context-parallel axis,
or under zero2 (``CUT_DATA_PARALLEL``), is counted on copies of the model cut to a few blocks (the Note below); a
pipeline plan keeps the figures of its stage graphs (``dpar.planner.plan_pipeline``).

[Note: a plan counted on copies cut to a few blocks]
Compiling a tensor-parallel plan's step costs about 5 s a block on 2 cores at Llama-3-8B's width (each rank's rows
run as copies of the program: [Note: the data contract under tensor parallel]), minutes for a real model's 32 to 126
blocks. Every figure the count reports is a sum over the blocks plus what lies outside them: compute, recomputation,
communication, the simulated step and the communication it leaves exposed grow by the same amount with each block of
the same kind, and so does each phase's peak (the forward's, at its end, holds every block's saved activations; the
backward's, early in it, most of them). So such a plan is counted on meta copies of the model whose block list
(``model_blocks``) is cut to two and to three consecutive blocks of the commonest kind M with such a run (a kind:
the blocks' parameters, their placements, the block's activation policy and its settings: the plain values its
modules hold, such as Hugging Face's ``sliding_window``, a block's number aside), giving c + 2m and c + 3m (c: what lies
outside the blocks), and for each other kind X to a block of X next to one of M, as the model has them (c + x + m).
The copies keep blocks that follow each other in the model, so what passes from block to block is what passes in the
model: blocks placed alternately (column- then row-split) are counted whole. Each figure is then ``c + n_M m + sum_X
n_X x``, and the memory the state plus the higher of the two phases' extrapolated peaks (``Memory.phase_peaks``: the
peak moves from the backward to the forward's end as blocks are added, so extrapolating the peak itself falls
short). One block alone is not a base: its backward peaks where a deeper model's does not (the tests' GPT under
ddp+cp: its backward's peak grew 837 kB from one block to two, 1,586 kB a block from two on; the 5-block count extrapolated from one and two
fell 8 % short). Measured on Hugging Face's Llama at Llama-3-8B's width cut to 8 layers, zero2+tp (SP) on 8 x 8
(2026-11-30): the extrapolation gives the 8-block count's memory at the step's peak to the byte, its compute, step
and exposed communication to 1e-12, keeping every activation and with full recomputation in 7 blocks and selective
in the last (from one and two blocks the step was 2e-4 off). Qwen2 256 wide with sliding-window attention in the
upper four of 8 layers, zero2 with selective recomputation on 8 ranks (2026-12-01): the copies of either kind and the
pair count alike, and the extrapolation falls short of the whole model's count by 32 kB of memory (0.03 %) and 0.03 %
of compute, the step to 1e-14. A model whose blocks are not one numbered
``nn.ModuleList`` or ``nn.Sequential``, one without three consecutive blocks of one kind, a policy given as a
budget of saved bytes, or so few blocks that the cut copies would cost as much, is counted whole. A plan priced so
prints no keep-every-activation column (counting it would cost the copies again).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from dpar.compiler.costs import DeviceSpec, device_spec
from dpar.core.errors import OptionsError
from dpar.core.plan import KEEP_ACTIVATIONS, ActivationPolicy
from dpar.core.torch_internals import pytree
from dpar.surgery.blocks import block_list, block_settings, with_blocks
from dpar.planner.plan import ON_BLOCK_GRAPHS, ON_GRAPHS, CostBreakdown, Plan
from dpar.side_processes import Job, SideProcesses

Figures = dict[str, float]  # what a count reports that grows with the blocks (``_figures``)
# The count's processes yield the cores to the pipeline search running beside them, whose answer may make the count
# moot (dpar.plan starts the count before it has that answer): Llama-3-405B on 2048 x 8 planned in 48.4 s with the
# count's two copies running at the same priority, its pipeline search slowed from 20 s to 34 s (2026-11-30).
COUNT_NICENESS = 10

CUT_DATA_PARALLEL = ("zero2",)
"""Data-parallel modes whose plan is counted on cut copies without a tp or cp axis too (the Note above). Measured
against the whole count on Hugging Face's Llama 256 wide cut to 8 layers, 2 rows of 128 tokens a rank on 8 ranks
(2026-11-30): zero2, on 8 and on 2 x 4 ranks, keeping every activation and recomputing selectively, gives every
figure to 1e-9; ddp and zero1 pack gradients into buckets by size, which a cut copy packs otherwise (memory 5 % and
13 % high, the step 14 % high), and fsdp's gathers overlap the first and last blocks otherwise (the step 2.7 % low,
the memory to the byte): those are counted whole. With a tp axis each is within 0.5 % (ddp+tp's step)."""


@dataclasses.dataclass(frozen=True)
class BlockCut:
    """Which of a model's blocks the cut copies keep, under a plan (see the Note)."""

    path: str  # the block list's module path (``inner.model.layers``)
    counts: tuple[int, ...]  # how many blocks of each kind, the base kind first
    run: tuple[int, int, int]  # three consecutive blocks of the base kind
    pairs: tuple[tuple[int, int], ...]  # for each other kind, two consecutive blocks: one of it, one of the base kind


def priced_on_graphs(chosen: Plan, model: nn.Module, example_inputs: Sequence[object] | torch.Tensor,
                     device: str | DeviceSpec = "h100") -> Plan:
    """``chosen`` with the figures ``dpar.explain`` reports for it on ``model`` fed ``example_inputs`` (the global
    batch the plan was priced at); a plan with a tensor- or context-parallel axis counted on copies cut to a few
    blocks, the copies compiled side by side (api/side_processes.py). See the Notes above."""
    with SideProcesses() as side:
        counting = count_on_graphs(chosen, model, example_inputs, device, side)
        return chosen if counting is None else counting.priced(chosen)


@dataclasses.dataclass
class Counting:
    """A plan's count on its compiled graphs under way: one job a compiled copy of the model (see the Notes)."""

    side: SideProcesses
    plan: Plan
    model: nn.Module
    inputs: tuple[object, ...]
    device: DeviceSpec
    cut: BlockCut | None  # None: the whole model, kept: the jobs' copies (the base kind's three, two, then the pairs)
    jobs: tuple[Job[Figures], ...]

    def priced(self, plan: Plan) -> Plan:
        """``plan`` (the counted plan, its rows of other strategies as they stand now) with the count's figures."""
        figures = self._collected()
        if self.cut is not None and figures is not None:
            three, two, *pairs = figures
            return dataclasses.replace(plan, cost=_cost(plan.cost, _extrapolated(self.cut, two, three, pairs)),
                                       priced_on=ON_BLOCK_GRAPHS)
        if figures is None:  # the cut copies could not be counted: the whole model instead
            self.cut, self.jobs = None, _whole_jobs(self.plan, self.model, self.inputs, self.device, self.side)
            figures = self._collected()
            assert figures is not None
        cost = _cost(plan.cost, figures[0])
        if len(figures) > 1:
            kept = figures[1]
            cost = dataclasses.replace(cost, memory_bytes_keep=round(kept["memory"]),
                                       activation_bytes_keep=round(kept["activations"]))
        return dataclasses.replace(plan, cost=cost, priced_on=ON_GRAPHS)

    def cancel(self) -> None:
        """The count dropped (the plan it was for is not the answer)."""
        self.side.cancel(*self.jobs)

    def _collected(self) -> list[Figures] | None:
        """Each job's figures; None where a cut copy could not be counted (warned: the whole model is counted)."""
        try:
            return [self.side.result(job) for job in self.jobs]
        except Exception as error:  # noqa: BLE001 - a forward that runs only its whole block list: counted whole
            if self.cut is None:
                raise
            self.cancel()
            warnings.warn(f"on_graphs: the copies of {type(self.model).__name__} cut to a few blocks could not be "
                          f"counted ({type(error).__name__}: {error}); counting the whole model instead", stacklevel=3)
            return None


def count_on_graphs(chosen: Plan, model: nn.Module, example_inputs: Sequence[object] | torch.Tensor,
                    device: str | DeviceSpec, side: SideProcesses) -> Counting | None:
    """The count of ``chosen`` on its compiled graphs, started on ``side`` (None for a pipeline plan, which its stage
    graphs priced): the copies of a plan with a tp or cp axis or under ``CUT_DATA_PARALLEL``, else the whole model
    (and, for a plan that recomputes, the whole model keeping every activation, for the before/after table)."""
    if chosen.pipeline is not None:
        return None
    device = device_spec(device)
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    cut = block_cut(model, chosen) if {"tp", "cp"} & set(chosen.mesh_dim_names) \
        or chosen.data_parallel in CUT_DATA_PARALLEL else None
    if cut is None:
        return Counting(side, chosen, model, inputs, device, None, _whole_jobs(chosen, model, inputs, device, side))
    jobs = tuple(  # the longest first: the others fill the cores as it runs
        side.submit(f"the count on a copy of blocks {kept} of {cut.path}",
                    functools.partial(_count, _cut_plan(chosen, cut.path, kept), model, inputs, device, (cut.path, kept)),
                    nice=COUNT_NICENESS)
        for kept in (cut.run, cut.run[:2], *cut.pairs))
    return Counting(side, chosen, model, inputs, device, cut, jobs)


def _whole_jobs(plan: Plan, model: nn.Module, inputs: tuple[object, ...], device: DeviceSpec,
                side: SideProcesses) -> tuple[Job[Figures], ...]:
    jobs = [side.submit("the count on the whole model", functools.partial(_count, plan, model, inputs, device),
                        nice=COUNT_NICENESS)]
    if plan.activations.recomputes:
        kept = dataclasses.replace(plan, activations=KEEP_ACTIVATIONS)
        jobs.append(side.submit("the count on the whole model keeping every activation",
                                functools.partial(_count, kept, model, inputs, device), nice=COUNT_NICENESS))
    return tuple(jobs)


def _count(plan: Plan, model: nn.Module, inputs: tuple[object, ...], device: DeviceSpec,
           blocks: tuple[str, tuple[int, ...]] | None = None) -> Figures:
    """The figures of ``plan``'s count on a meta copy of ``model`` (cut to ``blocks``)."""
    report = _inspected(plan, model, inputs, device, blocks)
    return dict(_figures(report), memory=report.memory.total, activations=report.memory.activations)


def block_cut(model: nn.Module, plan: Plan) -> BlockCut | None:
    """The model's blocks as the cut copies take them, or None where the plan is counted whole (see the Note)."""
    found = block_list(model)
    if found is None or plan.activations.budget_bytes is not None:
        return None
    path, container = found
    blocks = [f"{path}.{i}" for i in range(len(container))]
    kinds: dict[object, list[int]] = {}
    for i, (block, settings) in enumerate(zip(blocks, block_settings(list(container)))):
        own = tuple((p.name[len(block):], p.shape, p.placements) for p in plan.parameters if p.name.startswith(block + "."))
        kinds.setdefault((own, plan.activations.of_block(block), settings), []).append(i)
    members = list(kinds.values())
    kind_of = {i: k for k, of_kind in enumerate(members) for i in of_kind}
    # The copies keep blocks that follow each other in the model, so what passes between blocks is what the model
    # passes (two column-split layers never meet where the model alternates them with row-split ones).
    runs = [(kind_of[i], (i, i + 1, i + 2)) for i in range(len(blocks) - 2) if kind_of[i] == kind_of[i + 1] == kind_of[i + 2]]
    if not runs or 5 + 2 * (len(members) - 1) >= len(blocks):  # the cut copies' blocks against the model's
        return None
    base, run = max(runs, key=lambda r: len(members[r[0]]))
    pairs = []
    for kind in (k for k in range(len(members)) if k != base):
        pair = next(((i, i + 1) for i in range(len(blocks) - 1) if {kind_of[i], kind_of[i + 1]} == {kind, base}), None)
        if pair is None:
            return None
        pairs.append(pair)
    counts = (len(members[base]), *(len(m) for k, m in enumerate(members) if k != base))
    return BlockCut(path, counts, run, tuple(pairs))


def _extrapolated(cut: BlockCut, two: Figures, three: Figures, pairs: list[Figures]) -> Figures:
    """Each figure of the whole model from the cut copies' counts: c + 2m, c + 3m, and c + x + m for each other kind
    (see the Note)."""
    per_block = {f: three[f] - two[f] for f in two}
    outside = {f: two[f] - 2 * per_block[f] for f in two}
    base, *others = cut.counts
    total = {f: outside[f] + base * per_block[f] for f in two}
    for count, with_kind in zip(others, pairs):
        total = {f: v + count * (with_kind[f] - outside[f] - per_block[f]) for f, v in total.items()}
    return total


def _cut_plan(plan: Plan, path: str, kept: tuple[int, ...]) -> Plan:
    """``plan`` for the copy whose blocks are ``kept`` (renumbered from 0): their parameters and policies."""
    parameters = []
    for p in plan.parameters:
        if not p.name.startswith(path + "."):
            parameters.append(p)
            continue
        index, _, rest = p.name[len(path) + 1:].partition(".")
        parameters += [dataclasses.replace(p, name=f"{path}.{j}.{rest}") for j, k in enumerate(kept) if str(k) == index]
    policy = ActivationPolicy(blocks=tuple((f"{path}.{j}", plan.activations.of_block(f"{path}.{k}"))
                                           for j, k in enumerate(kept)))
    return dataclasses.replace(plan, parameters=tuple(parameters), activations=policy)


def _figures(report: Any) -> Figures:
    """The figures of a count that grow with the model's blocks: the state, each phase's peak, the times."""
    memory, timeline = report.memory, report.timeline
    (forward_gathered, forward_activations), (backward_gathered, backward_activations) = memory.phase_peaks
    return dict(
        state=memory.parameters + memory.gradients + memory.optimizer,
        forward_gathered=forward_gathered, forward_activations=forward_activations,
        backward_gathered=backward_gathered, backward_activations=backward_activations,
        compute=timeline.compute_time - report.recompute_time, recompute=report.recompute_time,
        comm=timeline.comm_time, exposed=timeline.exposed_comm, step=timeline.step_time,
    )


def _cost(searched: CostBreakdown, f: Figures) -> CostBreakdown:
    """The search's cost with the count's figures: memory the state plus the higher phase's peak."""
    phase = "forward" if f["forward_gathered"] + f["forward_activations"] >= f["backward_gathered"] + f["backward_activations"] else "backward"
    return dataclasses.replace(
        searched, compute_s=f["compute"], recompute_s=f["recompute"], comm_s=f["comm"], exposed_comm_s=f["exposed"],
        step_s=f["step"], memory_bytes_per_rank=round(f["state"] + f[f"{phase}_gathered"] + f[f"{phase}_activations"]),
        activation_bytes_per_rank=round(f[f"{phase}_activations"]), memory_bytes_keep=None, activation_bytes_keep=None,
    )


def _inspected(plan: Plan, model: nn.Module, inputs: tuple[object, ...], device: DeviceSpec,
               blocks: tuple[str, tuple[int, ...]] | None = None) -> Any:
    """``dpar.explain``'s report of ``plan`` on a meta copy of ``model``, each rank fed its slice of the batch;
    ``blocks`` (the block list's path, the blocks kept): the copy cut to those blocks."""
    from dpar.compiler.registry import figures_only
    from dpar.explaining import explain

    world, batch_size = math.prod(plan.mesh_shape), plan.batch_size
    if batch_size % world:
        raise OptionsError(f"on_graphs: the global batch of {batch_size} rows does not split over {world} ranks; "
                           "plan for a multiple of the world size")
    work, rank_inputs = _meta_copy(model, _first_rows(inputs, batch_size, batch_size // world))
    if blocks is not None:
        work = with_blocks(work, *blocks)
    with figures_only():  # the figures alone: no pass's code written
        return explain(work, rank_inputs, plan=plan, device=device)


def _first_rows(inputs: tuple[object, ...], batch_size: int, rows: int) -> tuple[object, ...]:
    """One rank's rows of the global batch: the first ``rows`` of every tensor whose dim 0 is the batch."""
    def first(x: object) -> object:
        return x[:rows] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch_size else x

    return tuple(pytree.tree_map(first, inputs))


def _meta_copy(model: nn.Module, inputs: tuple[object, ...]) -> tuple[nn.Module, tuple[object, ...]]:
    """A copy of ``model`` whose parameters and buffers are meta tensors shaped as its own (no data copied, ties
    kept), and the inputs on meta: pricing runs the forward, which on shapes alone (the planner's contract: the
    global batch may be uninitialised) must compute nothing, and must not touch the user's model."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    moved = pytree.tree_map(
        lambda x: x.detach().to("meta").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x, inputs)
    return copy.deepcopy(model, memo), tuple(moved)


__all__ = ["BlockCut", "Counting", "block_cut", "count_on_graphs", "priced_on_graphs"]
