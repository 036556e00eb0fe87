"""local SGD on 2 gloo ranks: the replicas, the average every H steps, and the known answers.

- plain SGD, H = 1: every forward sees torch DDP's parameters of that step;
- AdamW, H = 2, two micro-batches per step (the first under no_sync): each rank's replica
  equals a one-process simulation of both replicas (each its own AdamW on its own rows,
  averaged after every second step);
- a run saved mid-period and resumed in fresh models continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpar
from distributed import run_ranks
from models import MLP
from dpar.core.errors import OptionsError

ROWS = 4  # per rank


def batch(step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(ROWS * world_size, 16, generator=g), torch.randn(ROWS * world_size, 4, generator=g)


def rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size)[rank]


def step_on(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world_size: int, micro_batches: int,
            no_sync=contextlib.nullcontext) -> None:
    opt.zero_grad()
    for micro in range(micro_batches):
        x, y = batch(step, micro, world_size)
        with no_sync() if micro < micro_batches - 1 else contextlib.nullcontext():
            (F.mse_loss(model(rows(x, rank, world_size)), rows(y, rank, world_size)) / micro_batches).backward()
    opt.step()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_sgd_run(rank: int, world_size: int, make_opt, sync_every: int, steps: int, micro_batches: int = 1,
                  checkpoint: tuple[str, int] | None = None, outer: dpar.OuterSGD | None = None) -> tuple[list[dict], nn.Module]:
    """``steps`` steps under local SGD; the parameters after each. ``checkpoint=(dir, k)``: save after step k,
    then go on in a fresh model and optimizer loaded from it."""
    torch._dynamo.reset()
    torch.manual_seed(rank)  # rank 0's replica is broadcast at the first compile
    model = dpar.parallelize(MLP(), strategy="local_sgd", sync_every=sync_every, outer_optimizer=outer)
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    opt = make_opt(model.parameters())
    after = []
    for step in range(steps):
        step_on(compiled, opt, step, rank, world_size, micro_batches, lambda: dpar.no_sync(compiled))
        after.append(state(model))
        if checkpoint is not None and step + 1 == checkpoint[1]:
            dpar.checkpoint.save(compiled, opt, checkpoint[0])
            torch._dynamo.reset()
            torch.manual_seed(1234)
            model = dpar.parallelize(MLP(), strategy="local_sgd", sync_every=sync_every, outer_optimizer=outer)
            compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
            opt = make_opt(model.parameters())
            dpar.checkpoint.load(compiled, opt, checkpoint[0])
    return after, compiled


def simulated_replicas(world_size: int, make_opt, sync_every: int, steps: int, micro_batches: int,
                       outer: dpar.OuterSGD | None = None) -> list[dict]:
    """Each rank's replica after ``steps`` steps, in one process: every replica its own optimizer and
    rows, the replicas' parameters averaged (or DiLoCo's outer step taken, with torch's SGD on the
    anchors) before the forward that follows every ``sync_every``-th step."""
    torch.manual_seed(0)
    start = MLP()
    replicas = [copy.deepcopy(start) for _ in range(world_size)]
    opts = [make_opt(r.parameters()) for r in replicas]
    anchors = [p.detach().clone().requires_grad_() for p in start.parameters()]
    outer_opt = torch.optim.SGD(anchors, lr=outer.lr, momentum=outer.momentum, nesterov=outer.nesterov) if outer else None
    for step in range(steps):
        if step and step % sync_every == 0:
            with torch.no_grad():
                for anchor, params in zip(anchors, zip(*(r.parameters() for r in replicas))):
                    mean = sum(p / world_size for p in params)
                    if outer_opt is not None:
                        anchor.grad = anchor - mean
                    else:
                        anchor.copy_(mean)
                if outer_opt is not None:
                    outer_opt.step()
                for anchor, params in zip(anchors, zip(*(r.parameters() for r in replicas))):
                    for p in params:
                        p.copy_(anchor)
        for rank, (replica, opt) in enumerate(zip(replicas, opts)):
            step_on(replica, opt, step, rank, world_size, micro_batches)
    return [state(r) for r in replicas]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def rank_main(rank: int, world_size: int, directory: str) -> dict:
    results: dict = {}
    # H = 1 with plain SGD: the forward of step k averages the replicas' step k - 1.
    after, compiled = local_sgd_run(rank, world_size, sgd, sync_every=1, steps=4)
    x, _ = batch(4, 0, world_size)
    compiled(rows(x, rank, world_size))  # the forward of step 5: averages step 4
    results["h1"] = state(compiled._orig_mod)
    torch.manual_seed(0)
    reference = MLP()
    ddp = nn.parallel.DistributedDataParallel(reference)
    opt = sgd(reference.parameters())
    for step in range(4):
        step_on(ddp, opt, step, rank, world_size, 1)
    results["ddp"] = state(reference)

    # H = 2, AdamW, two micro-batches per step.
    after, compiled = local_sgd_run(rank, world_size, adamw, sync_every=2, steps=5, micro_batches=2)
    results["h2"] = after[-1]

    # DiLoCo: SGD inside, Nesterov outside; outer lr 1 without momentum is the plain average.
    results["diloco"] = local_sgd_run(rank, world_size, sgd, sync_every=2, steps=5, outer=DILOCO)[0][-1]
    results["outer_plain"] = local_sgd_run(rank, world_size, sgd, sync_every=2, steps=5, outer=PLAIN)[0][-1]
    results["plain"] = local_sgd_run(rank, world_size, sgd, sync_every=2, steps=5)[0][-1]

    # Saved after step 3 (mid-period for H = 2), resumed in a fresh model (DiLoCo: anchors and momenta too).
    uninterrupted, _ = local_sgd_run(rank, world_size, adamw, sync_every=2, steps=6, outer=DILOCO)
    resumed, _ = local_sgd_run(rank, world_size, adamw, sync_every=2, steps=6, checkpoint=(directory, 3), outer=DILOCO)
    results["uninterrupted"], results["resumed"] = uninterrupted[-1], resumed[-1]
    return results


DILOCO = dpar.OuterSGD(lr=0.7, momentum=0.9)
PLAIN = dpar.OuterSGD(lr=1.0, momentum=0.0, nesterov=False)


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        return run_ranks(rank_main, 2, directory, timeout_s=300)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_plain_sgd_averaged_every_step_is_ddp(trained) -> None:
    for rank in range(2):
        assert max_diff(trained[rank]["h1"], trained[rank]["ddp"]) <= 1e-6


def test_each_replica_is_the_simulated_one_between_averages(trained) -> None:
    want = simulated_replicas(2, adamw, sync_every=2, steps=5, micro_batches=2)
    for rank in range(2):
        assert max_diff(trained[rank]["h2"], want[rank]) <= 1e-5
    # The replicas were averaged before the forwards of steps 3 and 5 (indices 2 and 4), and have
    # since taken one step each on different rows: they differ.
    assert max_diff(trained[0]["h2"], trained[1]["h2"]) > 1e-4


def test_diloco_takes_torch_sgds_nesterov_step_on_the_averaged_delta(trained) -> None:
    want = simulated_replicas(2, sgd, sync_every=2, steps=5, micro_batches=1, outer=DILOCO)
    for rank in range(2):
        assert max_diff(trained[rank]["diloco"], want[rank]) <= 1e-6
        assert max_diff(trained[rank]["outer_plain"], trained[rank]["plain"]) <= 1e-6
    assert max_diff(trained[0]["diloco"], trained[0]["plain"]) > 1e-4  # the outer momentum moved it


def test_a_run_resumed_mid_period_continues_exactly(trained) -> None:
    for rank in range(2):
        assert max_diff(trained[rank]["resumed"], trained[rank]["uninterrupted"]) == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"strategy": "local_sgd"}, "needs sync_every"),
        ({"strategy": "local_sgd", "sync_every": 0}, "integer >= 1"),
        ({"strategy": "fsdp", "sync_every": 4}, "drop sync_every, or choose strategy='local_sgd'"),
        ({"strategy": "local_sgd", "sync_every": 4, "bucket_cap_mb": 1}, "no gradient buckets"),
        ({"strategy": "local_sgd", "sync_every": 4, "sequence_parallel": True}, "needs a tensor-parallel strategy"),
        ({"strategy": "ddp", "outer_optimizer": dpar.OuterSGD()}, "outer_optimizer is local SGD's outer step"),
    ],
)
def test_bad_input_is_named(kwargs: dict, message: str) -> None:
    with pytest.raises(OptionsError, match=message):
        dpar.parallelize(MLP(), **kwargs)


def llama_against_torch_ddp(rank: int, world_size: int) -> float:
    """A Hugging Face Llama (random config) fed per-rank slices: local SGD at H = 1 with plain SGD,
    after the forward that averages the last step, against torch DDP's parameters."""
    from third_party import ROWS_PER_RANK, STEPS, Run, build, global_batch, max_abs_diff, rank_slice, train

    reference = train(rank, world_size, Run("llama", "torch_ddp", optimizer="sgd"))
    torch._dynamo.reset()
    model = build("llama")
    dpar.parallelize(model, strategy="local_sgd", sync_every=1)
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS + 1):  # the last forward only averages
        opt.zero_grad()
        loss = compiled(*rank_slice(global_batch(step, ROWS_PER_RANK * world_size), rank, world_size))
        if step < STEPS:
            loss.backward()
            opt.step()
    return max_abs_diff(reference, state(model))


def test_a_hugging_face_llama_averaged_every_step_is_ddp() -> None:
    diffs = run_ranks(llama_against_torch_ddp, 2, timeout_s=600)
    print(f"llama, 2 ranks, {diffs=}")
    assert max(diffs) <= 1e-6
