"""dpar composes with Inductor: the post-pass graphs, collectives included, compile and train.

fsdp also goes through Inductor's partitioner with dpar's recompute tags.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks
from models import MLP

STEPS = 3


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def rank_main(rank: int, world_size: int, strategy: str) -> dict:
    import dpar

    torch.manual_seed(rank if strategy == "ddp" else 0)  # ddp broadcasts rank 0's; shards come from rank 0
    model = MLP()
    small = {"bucket_cap_mb": 0.01}  # several buckets: ddp sizes them when compiling, fsdp in parallelize
    dpar.parallelize(model, strategy=strategy, **({} if strategy == "ddp" else small))
    compiled = torch.compile(model, backend="dpar", options={"compiler": "inductor", **(small if strategy == "ddp" else {})})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = (t.chunk(world_size)[rank] for t in batch(step, 4 * world_size))
        with dpar.no_sync(compiled):  # one accumulated micro-batch, then a synchronising one
            F.mse_loss(compiled(x), y).backward()
        F.mse_loss(compiled(x * 2), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
# ddp's no_sync trains by default under aot_eager (test_ddp_numerics), and Inductor lowers ddp's graphs by default in
# the lowering test below; their meeting runs by `-m extended`.
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.extended), "fsdp"])
def test_inductor_with_no_sync_matches_one_process_on_the_whole_batch(strategy: str) -> None:
    per_rank = run_ranks(rank_main, 2, strategy, timeout_s=600)
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, 8)
        (F.mse_loss(model(x), y) + F.mse_loss(model(x * 2), y)).backward()
        opt.step()
        opt.zero_grad()
    for rank, got in enumerate(per_rank):
        for name, want in model.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-5, msg=f"rank {rank} {name}")


# zero2's and hsdp's inserted ops are ddp's and fsdp's: `-m extended`.
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero2", marks=pytest.mark.extended), "fsdp",
                                      pytest.param("hsdp", marks=pytest.mark.extended), "fsdp+tp"])
def test_every_op_dpars_passes_insert_has_an_inductor_lowering(strategy: str) -> None:
    """Inductor gets dpar's graphs after AOTAutograd decomposed them: an op a pass inserts must have a
    lowering of its own (aten.zeros, say, has only a decomposition, and Inductor refuses the graph).
    Tied weights exercise fsdp's summed reduce-scatter."""
    import re

    import torch._inductor.lowering
    from torch._inductor.decomposition import select_decomp_table

    import dpar
    from training import tiny_gpt

    model = tiny_gpt()
    assert model.lm_head.weight is model.tok_emb.weight  # tied
    report = dpar.explain(model, (torch.zeros(4, 16, dtype=torch.long),) * 2, world_size=4, strategy=strategy)
    ops = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)")
    inserted = set()
    for view in report.graphs:
        inserted |= set(ops.findall(view.stages[-1].code)) - set(ops.findall(view.stages[0].code))
    assert inserted, "the passes inserted no op: nothing was checked"
    lowerings, decompositions = torch._inductor.lowering.lowerings, select_decomp_table()
    refused = sorted(
        ".".join(op) for op in inserted
        if (target := getattr(getattr(getattr(torch.ops, op[0]), op[1]), op[2])) not in lowerings and target in decompositions
    )  # an op with neither gets a fallback kernel (dpar's own custom ops)
    assert not refused, f"{strategy}: only a decomposition, no Inductor lowering, for {refused}"
