"""Fuzzing every strategy against torch DDP on small random models (``fuzz_models.ModelSpec``).

hypothesis draws the models in this process (a fixed seed per world size, so CI sees the same
cases every run); all of one world size's cases and strategies then run in ONE ``run_ranks``
launch, because starting gloo ranks costs seconds and a compile with ``aot_eager`` well under
one. Inside the ranks each (model, strategy) trains ``STEPS`` steps on per-rank slices and is
compared with torch DDP fed the same slices: every parameter (rank 0's gathered view, and every
rank's own where parameters are whole) and, where the strategy promises DDP's buffers, every
rank's buffers. Any error is a failure. Tensor parallel takes Megatron's plan with every dimension
too narrow to give each rank a block replicated instead (``tp_plan``): with widths of 1-12 the
plan as it is would be refused (``OptionsError``) for most models at 3 and 4 ranks.

``DPAR_FUZZ_EXAMPLES=200 pytest tests/test_fuzz_strategies.py`` draws 200 models per world size
instead of CI's few (``DPAR_FUZZ_SEED`` picks other ones). A failing case prints as
``FuzzCase(...)``; with ``DPAR_FUZZ_SHRINK=1`` hypothesis also shrinks the first one (``shrunk``).
Paste the smallest into ``REGRESSIONS`` and fix the bug (or mark it xfail, strict, with why).
"""

from __future__ import annotations

import dataclasses
import os
import traceback

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from distributed import RankFailed, run_ranks
from fuzz_models import ModelSpec, build, global_batch, loss_of, model_specs

STEPS = 4
ROWS_PER_RANK = 3
TOLERANCE = {"sgd": 1e-5, "adamw": 1e-4}  # ../shared/design/NOTES.md
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "local_sgd")
WHOLE_PARAMETERS = {"ddp", "zero1", "local_sgd"}  # every rank holds every parameter whole
DDP_BUFFERS = {"ddp", "zero1", "zero2", "fsdp", "hsdp", "tp"}  # README: each rank's buffers are DDP's
CI_EXAMPLES = {1: 3, 2: 4, 3: 3, 4: 3}  # models per world size in CI


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    spec: ModelSpec
    optimizer: str  # "sgd" (momentum 0.9) or "adamw"; local_sgd always trains with plain SGD


# Failing cases the fuzzer found, minimised: (world size, case, strategies, what was wrong).
REGRESSIONS = [
    pytest.param(
        1,
        FuzzCase(spec=ModelSpec(inputs=1, widths=(), outputs=1), optimizer='sgd'),
        ("tp",),
        id="tp-at-world-size-1",  # dpar::tensor_parallel_grad returned its own input (a full-size block): RuntimeError
    ),
]


def strategies_for(world_size: int) -> tuple[str, ...]:
    return tuple(s for s in STRATEGIES if s != "hsdp" or world_size == 4)  # hsdp: a 2x2 mesh


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "plain_sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def rank_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size)[rank]


def torch_ddp(spec: ModelSpec, optimizer: str, rank: int, world_size: int) -> nn.Module:
    model = build(spec)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=spec.unused)
    opt = make_optimizer(optimizer, model)
    for step in range(STEPS):
        x, y = (rank_rows(t, rank, world_size) for t in global_batch(spec, step, ROWS_PER_RANK * world_size))
        opt.zero_grad()
        loss_of(spec, ddp, x, y).backward()
        opt.step()
    return model


def tensor_parallel_plan(model: nn.Module, x: torch.Tensor, world_size: int) -> dict[str, int | None]:
    """Megatron's plan for ``model``, each dimension narrower than a block per rank replicated."""
    from dpar.compiler.megatron import megatron_dims
    from dpar.core.facts import can_split

    shapes = {n: p.shape for n, p in model.named_parameters()}
    dims = megatron_dims(model, (x,))
    return {n: d if d is None or can_split(shapes[n][d], world_size) else None for n, d in dims.items()}


def dpar_trained(spec: ModelSpec, optimizer: str, strategy: str, rank: int, world_size: int) -> nn.Module:
    import dpar
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = build(spec)
    batch = lambda step: [rank_rows(t, rank, world_size) for t in global_batch(spec, step, ROWS_PER_RANK * world_size)]
    kwargs: dict = {}
    if strategy == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    if strategy == "tp":
        kwargs["tp_plan"] = tensor_parallel_plan(model, batch(0)[0], world_size)
    if strategy == "local_sgd":
        kwargs["sync_every"] = 1
    dpar.parallelize(model, strategy=strategy, **kwargs)
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "check_timeout_s": 30})
    opt = make_optimizer(optimizer, model)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        loss_of(spec, compiled, x, y).backward()
        opt.step()
    if strategy == "local_sgd":  # the forward after a step averages that step's replicas
        compiled(batch(STEPS)[0])
    return model


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((float((a[k].detach().double() - b[k].detach().double()).abs().max()) for k in a if a[k].numel()), default=0.0)


def compare(case: FuzzCase, strategy: str, rank: int, world_size: int, reference: nn.Module) -> dict:
    """This rank's differences from torch DDP: {"parameters": ..., "buffers": ...} (absent: not compared)."""
    import dpar

    model = dpar_trained(case.spec, "plain_sgd" if strategy == "local_sgd" else case.optimizer, strategy, rank, world_size)
    buffers = {k for k, _ in reference.named_buffers()}
    full = dpar.checkpoint.full_state_dict(model)  # every rank takes part; rank 0 gets it
    diffs: dict[str, float] = {}
    want = reference.state_dict()
    if full is not None:
        kept = {k for k in want if strategy in DDP_BUFFERS or k not in buffers}
        diffs["parameters"] = max_abs_diff({k: full[k] for k in kept}, {k: want[k] for k in kept})
    if strategy in WHOLE_PARAMETERS:
        own = dict(model.named_parameters(remove_duplicate=False))
        diffs["parameters"] = max(diffs.get("parameters", 0.0), max_abs_diff(own, {k: want[k] for k in own}))
    if strategy in DDP_BUFFERS:
        diffs["buffers"] = max_abs_diff(dict(model.named_buffers()), {k: want[k] for k in buffers})
    return diffs


def rank_main(rank: int, world_size: int, runs: list[tuple[FuzzCase, tuple[str, ...]]]) -> list[dict]:
    """Each case under each of its strategies: {"moved": how far torch DDP moved the parameters,
    "strategies": {strategy: diffs, or "ErrorClass: message and traceback"}}."""
    results = []
    for index, (case, strategies) in enumerate(runs):
        start = build(case.spec).state_dict()
        references = {case.optimizer: torch_ddp(case.spec, case.optimizer, rank, world_size),
                      "plain_sgd": torch_ddp(case.spec, "plain_sgd", rank, world_size)}
        moved = min(max_abs_diff(start, r.state_dict()) for r in references.values())
        outcome: dict = {}
        for strategy in strategies:
            reference = references["plain_sgd" if strategy == "local_sgd" else case.optimizer]
            try:
                outcome[strategy] = compare(case, strategy, rank, world_size, reference)
            except Exception as exc:  # recorded, so the other strategies still run; any error fails the test
                outcome[strategy] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
        results.append({"moved": moved, "strategies": outcome})
        print(f"rank {rank}: case {index + 1}/{len(runs)} done", flush=True)
    return results


def problems(case: FuzzCase, world_size: int, per_rank: list[dict]) -> list[tuple[str, str]]:
    """(strategy, what is wrong) for one case's results on every rank; empty: it matches torch DDP."""
    found = []
    for rank, result in enumerate(per_rank):
        for strategy, outcome in result["strategies"].items():
            if isinstance(outcome, str):
                found.append((strategy, f"{strategy} on rank {rank} of {world_size} raised {outcome}"))
                continue
            limit = TOLERANCE["sgd"] if strategy == "local_sgd" else TOLERANCE[case.optimizer]
            for what, diff in outcome.items():
                if not diff <= limit:
                    found.append((strategy, f"{strategy} on rank {rank} of {world_size}: {what} differ from torch DDP by {diff:.3g}"))
    return found


def fuzz_cases(blocks: bool = False) -> st.SearchStrategy[FuzzCase]:
    """``blocks``: only models with a convolution + BatchNorm or a mixture of experts (``ModelSpec.block``)."""
    specs = model_specs().filter(lambda spec: spec.block != "none") if blocks else model_specs()
    return st.builds(FuzzCase, specs, st.sampled_from(["sgd", "adamw"]))


def examples(world_size: int) -> int:
    return int(os.environ.get("DPAR_FUZZ_EXAMPLES", CI_EXAMPLES[world_size]))


def draw_seed(world_size: int) -> int:
    return int(os.environ.get("DPAR_FUZZ_SEED", 0)) * 10 + world_size


def drawn_cases(world_size: int, blocks: bool = False) -> list[FuzzCase]:
    """The cases for ``world_size``: hypothesis's draws under a fixed seed (no database, no shrinking)."""
    drawn: list[FuzzCase] = []

    @seed(draw_seed(world_size))
    @settings(max_examples=examples(world_size), database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_cases(blocks))
    def collect(case: FuzzCase) -> None:
        if case not in drawn:
            drawn.append(case)

    collect()
    return drawn


def shrunk(target: FuzzCase, world_size: int, strategy: str) -> FuzzCase:
    """hypothesis's smallest case that still fails under ``strategy``, starting from ``target``, a
    case ``drawn_cases`` drew. Local only (``DPAR_FUZZ_SHRINK=1``): one launch per candidate.

    The same seed draws the same cases again; those before ``target`` passed, so they are not
    run, and ``target`` is known to fail. From there hypothesis shrinks, and every candidate it
    tries runs for real. Both failures raise from one line, so hypothesis sees one bug.
    """
    smallest: list[FuzzCase] = []

    @seed(draw_seed(world_size))
    @settings(max_examples=examples(world_size), database=None, phases=[Phase.generate, Phase.shrink],
              deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(fuzz_cases())
    def passes(case: FuzzCase) -> None:
        if not smallest and case != target:
            return
        failing = case == target or any(s == strategy for _, found in failures([(case, (strategy,))], world_size) for s, _ in found)
        if failing:
            smallest[:] = [case]
        assert not failing

    try:
        passes()
    except AssertionError:
        pass
    return smallest[0]


def tally(runs: list[tuple[FuzzCase, tuple[str, ...]]], world_size: int) -> dict[str, int]:
    """strategy -> models it trained; for tp also how many of them it split a parameter of."""
    counts: dict[str, int] = {}
    for case, strategies in runs:
        for strategy in strategies:
            counts[strategy] = counts.get(strategy, 0) + 1
        if "tp" in strategies:
            model = build(case.spec)
            x = global_batch(case.spec, 0, ROWS_PER_RANK * world_size)[0].chunk(world_size)[0]
            split = any(d is not None for d in tensor_parallel_plan(model, x, world_size).values())
            counts["tp that split a parameter"] = counts.get("tp that split a parameter", 0) + split
    return counts


def failures(runs: list[tuple[FuzzCase, tuple[str, ...]]], world_size: int) -> list[tuple[FuzzCase, list[tuple[str, str]]]]:
    """Every run in one launch of ``world_size`` ranks: each case that went wrong, with its problems."""
    try:
        per_rank = run_ranks(rank_main, world_size, runs, timeout_s=120 + 20 * world_size * len(runs))
    except RankFailed as exc:  # outside one strategy's try (the reference, a hang)
        return [(runs[0][0], [("", str(exc))])]
    # A model whose gradient is all zero (every ReLU dead) cannot tell a wrong strategy from a right one.
    informative = sum(r["moved"] > 10 * TOLERANCE[case.optimizer] for (case, _), r in zip(runs, per_rank[0]))
    print(f"world size {world_size}, {len(runs)} models ({informative} that train): {tally(runs, world_size)}")
    if 2 * informative < len(runs):
        return [(runs[0][0], [("", f"only {informative} of {len(runs)} models moved their parameters: the draw tells nothing")])]
    found = [(case, problems(case, world_size, [r[index] for r in per_rank])) for index, (case, _) in enumerate(runs)]
    return [(case, wrong) for case, wrong in found if wrong]


def report(wrong: list[tuple[FuzzCase, list[tuple[str, str]]]], world_size: int) -> str:
    return "\n".join(f"{case!r} at world size {world_size}:\n  " + "\n  ".join(m for _, m in found) for case, found in wrong)


# 3 and 4 ranks (uneven shards, hsdp's 2x2) run by `-m extended`: uneven shards train by default in test_zero1's and
# test_sharded_numerics' 4-rank cases, hsdp in test_third_party_models' 4-rank Llama.
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.extended),
                                        pytest.param(4, marks=pytest.mark.extended)], ids=lambda n: f"{n}ranks")
def test_every_strategy_trains_random_models_as_torch_ddp(world_size: int) -> None:
    cases = drawn_cases(world_size)
    print(f"{len(cases)} models x {len(strategies_for(world_size))} strategies at world size {world_size}")
    wrong = failures([(case, strategies_for(world_size)) for case in cases], world_size)
    if wrong and os.environ.get("DPAR_FUZZ_SHRINK"):
        first = next(((case, s) for case, found in wrong for s, _ in found if s), None)
        if first is not None:
            print(f"minimised under {first[1]}: {shrunk(first[0], world_size, first[1])!r}")
    assert not wrong, report(wrong, world_size)


def test_tensor_parallel_trains_random_models_with_convolutions_and_experts_as_torch_ddp() -> None:
    """Tensor parallel's plan on models with a layer it cannot split (a convolution and BatchNorm,
    routed experts): those stay replicated and train as DDP would, the Linears around them split."""
    cases = drawn_cases(2, blocks=True)
    print(f"{len(cases)} models with blocks: {[case.spec.block for case in cases]}")
    wrong = failures([(case, ("tp",)) for case in cases], 2)
    assert not wrong, report(wrong, 2)


@pytest.mark.parametrize("world_size, case, strategies", REGRESSIONS)
def test_a_case_the_fuzzer_found_trains_as_torch_ddp(world_size: int, case: FuzzCase, strategies: tuple[str, ...]) -> None:
    wrong = failures([(case, strategies)], world_size)
    assert not wrong, report(wrong, world_size)
