"""Expert parallelism ("ep"): routed experts spread over ranks, tokens exchanged by all-to-all in the graphs.

Each rank is fed its own slice of the batch; after 5 AdamW steps every parameter (the experts' gathered whole)
must be torch DDP's on the same slices. fp32 noise is measured, not assumed: DDP trained again from weights
nudged by 1e-7 moves by a control gap, and the ep run must stay within a few times that gap (the experts see
their rows in another order and the dense own MoE sums its experts in another order); in float64 the own
MoE must agree within 1e-9. The forward graph holds the all-to-alls (a wrong routing that skipped them would
leave some experts untrained and fail the comparison), and the graphs compile once for all steps.
"""

from __future__ import annotations

import pytest

from distributed import run_ranks

NUDGE = 1e-7


def _nudge(model) -> None:
    import torch

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * NUDGE)


def _against_torch_ddp(rank: int, world_size: int, cases: tuple[tuple[str, str, tuple[int, ...] | None], ...]) -> dict | None:
    import torch
    import torch._dynamo

    from dpar.compiler import registry
    from third_party import Run, max_abs_diff, train

    found, references = {}, {}
    for name, strategy, mesh_shape in cases:
        if name not in references:
            references[name] = (train(rank, world_size, Run(name, "torch_ddp")),
                                train(rank, world_size, Run(name, "torch_ddp"), prepare=_nudge))
        reference, control = references[name]
        torch._dynamo.reset()
        with registry.recording() as graphs:
            state, compiled = _train(rank, world_size, name, strategy, mesh_shape, graphs)
        kinds = [c.kind for g in graphs if g.label == "forward graph" for c in g.collectives]
        label = f"{strategy} {mesh_shape or world_size}, {name}"
        found[label] = dict(
            graphs_after_each_step=compiled, all_to_alls=kinds.count("all_to_all"),
            gap=max_abs_diff(reference, state) if rank == 0 else None,
            control=max_abs_diff(reference, control) if rank == 0 else None,
        )
        if name == "own_moe":
            double = lambda model: model.double()
            torch._dynamo.reset()
            reference = train(rank, world_size, Run(name, "torch_ddp"), prepare=double)
            state = _train(rank, world_size, name, strategy, mesh_shape, [], prepare=double)[0]
            found[label]["float64"] = max_abs_diff(reference, state) if rank == 0 else None
    return found if rank == 0 else None


def _train(rank: int, world_size: int, name: str, strategy: str, mesh_shape: tuple[int, ...] | None, graphs: list,
           prepare=None) -> tuple[dict | None, list[int]]:
    """third_party.train's loop, counting the graphs compiled after each step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dpar
    from third_party import ROWS_PER_RANK, STEPS, build, global_batch, rank_slice

    model = build(name)
    if prepare is not None:
        prepare(model)
    mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "ep"))
    dpar.parallelize(model, strategy=strategy, mesh=mesh)
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = []
    for step in range(STEPS):
        optimizer.zero_grad()
        runner(*rank_slice(global_batch(step, ROWS_PER_RANK * world_size), rank, world_size)).backward()
        optimizer.step()
        compiled.append(len(graphs))
    return dpar.checkpoint.full_state_dict(model), compiled


CASES = {
    2: tuple((name, "ep", None) for name in ("own_moe", "mixtral", "qwen3_moe")),
    4: (("own_moe", "ep", None), ("mixtral", "ep", None), ("own_moe", "ddp+ep", (2, 2)), ("qwen3_moe", "ddp+ep", (2, 2))),
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_trains_as_torch_ddp(world_size: int) -> None:
    found = run_ranks(_against_torch_ddp, world_size, CASES[world_size], timeout_s=1200)[0]
    for name, figures in found.items():
        print(f"{name}: {figures}")
    for name, f in found.items():
        assert f["all_to_alls"] == 2 * 3, (name, f)  # per MoE layer: tokens and their experts out, outputs back
        assert f["gap"] <= max(10 * f["control"], 1e-6), (name, f)
        assert f["control"] > 0
        assert len(set(f["graphs_after_each_step"])) == 1, (name, f)  # nothing compiled after the first step
    assert all(f["float64"] < 1e-9 for name, f in found.items() if name.endswith("own_moe"))
