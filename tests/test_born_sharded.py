"""Models born on the meta device (the FSDP2/torchtitan recipe), under every strategy.

``with torch.device("meta"): build()`` -> ``dpar.parallelize`` -> ``to_empty`` -> the model's own init of its
non-persistent buffers -> weights loaded (``set_model_state_dict`` broadcast from rank 0, or ``dcp.load``) ->
train, equal to torch DDP started from the same weights. See [Note: facts keyed by name, not by tensor] and
[Note: state of a model born on meta] in core/model_state.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import dpar
from distributed import run_ranks

TOLERANCE = 1e-4
# (strategy, 2-D mesh shape or None, how the weights arrive). The 2-D strategies at dp 2 x tp 2 through
# set_model_state_dict are test_reshard's cases.
CASES = (
    ("ddp", None, "broadcast"), ("zero1", None, "broadcast"), ("zero2", None, "broadcast"),
    ("fsdp", None, "broadcast"), ("hsdp", (1, 2), "broadcast"), ("tp", None, "broadcast"),
    ("ddp+tp", (1, 2), "broadcast"), ("local_sgd", None, "broadcast"),  # with SGD: averaging replicas after
    # every SGD step from one start is averaging gradients (after AdamW's it is not)
    ("fsdp", None, "dcp"), ("zero2+tp", (1, 2), "broadcast"), ("fsdp+tp", (1, 2), "dcp"),
)


def _init_rotary(model: nn.Module) -> None:
    """What an HF user does after to_empty: the model's own init of its rotary buffers (non-persistent)."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            model.inner._init_weights(module)


def _born_on_meta(rank: int, world_size: int, checkpoint_dir: str, cases: tuple) -> dict[str, float | str]:
    import torch._dynamo
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import third_party as tp

    torch.manual_seed(0)
    full = {k: v.detach().clone() for k, v in tp.build("llama").state_dict().items()}
    want = {
        name: tp.train(rank, world_size, tp.Run("llama", "torch_ddp", optimizer=name), prepare=lambda m: m.load_state_dict(full))
        for name in ("adamw", "sgd")
    }
    plain = tp.build("llama")
    plain.load_state_dict(full)
    dcp.save(plain.state_dict(), checkpoint_id=checkpoint_dir)  # a plain (torch) model's checkpoint
    found: dict[str, float | str] = {}
    for strategy, mesh_shape, load in cases:
        torch._dynamo.reset()
        label = f"{strategy} mesh {mesh_shape} via {load}"
        started = time.perf_counter()
        with torch.device("meta"):
            model = tp.build("llama")
        kwargs: dict = {"sync_every": 1} if strategy == "local_sgd" else {}
        if mesh_shape is not None:
            names = ("replicate", "shard") if strategy == "hsdp" else ("dp", "tp")
            kwargs["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        example = tp.rank_slice(tp.global_batch(0, tp.ROWS_PER_RANK * world_size), rank, world_size)
        dpar.parallelize(model, strategy=strategy, example_inputs=example, **kwargs)
        # Nothing was allocated: every parameter (shard, block) is still on meta.
        local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
        assert all(t.is_meta for t in local), label
        model.to_empty(device="cpu")
        _init_rotary(model)
        if load == "broadcast":
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, dict(full) if rank == 0 else {}, options=options)  # torch writes into the dict
        else:
            state = get_model_state_dict(model)
            dcp.load(state, checkpoint_id=checkpoint_dir)
            set_model_state_dict(model, state)
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        name = "sgd" if strategy == "local_sgd" else "adamw"
        optimizer = tp._optimizer(name, [p for p in model.parameters() if p.requires_grad])
        for step in range(tp.STEPS):
            optimizer.zero_grad()
            ids, labels, mask = tp.rank_slice(tp.global_batch(step, tp.ROWS_PER_RANK * world_size), rank, world_size)
            runner(ids, labels, mask).backward()
            optimizer.step()
        if strategy == "local_sgd":  # the forward that follows a step averages it (tests/test_local_sgd.py)
            runner(*tp.rank_slice(tp.global_batch(tp.STEPS, tp.ROWS_PER_RANK * world_size), rank, world_size))
        if strategy == "zero1":  # the optimizer stepped this rank's ranges of the materialized parameters
            from dpar.core.facts import any_zero1

            assert all(any_zero1([p]) for p in model.parameters() if p.requires_grad), label
        got = dpar.checkpoint.full_state_dict(model)
        if rank == 0:
            found[label] = tp.max_abs_diff(want[name], got)
            print(f"{label}: {time.perf_counter() - started:.1f} s", flush=True)
        dist.barrier()
    return found


# ddp, zero1, zero2 and hsdp (replicated and sharded as tp's unsplit parameters and fsdp are), ddp+tp and zero2+tp
# (fsdp+tp's 2-D load, which set_model_state_dict's cases of test_reshard take too) and local SGD: `-m extended`.
EXTENDED = tuple(c for c in CASES if c[0] in ("ddp", "zero1", "zero2", "hsdp", "ddp+tp", "zero2+tp", "local_sgd"))


@pytest.mark.parametrize("cases", [tuple(c for c in CASES if c not in EXTENDED), pytest.param(EXTENDED, marks=pytest.mark.extended)],
                         ids=["default", "extended"])
def test_a_model_born_on_meta_trains_as_torch_ddp_under_every_strategy(tmp_path, cases: tuple) -> None:
    import third_party as tp

    found = run_ranks(_born_on_meta, 2, str(tmp_path / "plain"), cases, timeout_s=900)[0]
    tp.assert_figures(found, "born on meta", TOLERANCE, len(cases))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 8)
        self.register_buffer("scale", torch.full((4,), 0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids) * self.scale).square().mean()


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def test_facts_survive_to_empty_swap_and_assign(one_rank) -> None:
    """Sharded parameters are DTensors, which to_empty swaps in place (swap_tensors refuses a tensor any weak
    reference points at) and load_state_dict(assign=True) replaces: the plan and the shards' facts stay."""
    from dpar.core.plan import plan_of_parameters
    from dpar.core.facts import spec_of

    torch.manual_seed(0)
    full = _Tiny().state_dict()
    with torch.device("meta"):
        model = _Tiny()
    dpar.parallelize(model, strategy="fsdp")
    model.to_empty(device="cpu")  # swap_tensors on every DTensor parameter
    weight = lambda: model.proj._parameters["weight"]  # the attribute reads the gathered full tensor
    assert spec_of(weight()).global_shape == (8, 4)
    assert plan_of_parameters(dict(model.named_parameters())).strategy.value == "fsdp"
    model.load_state_dict(full, assign=True)  # new Parameter objects
    assert isinstance(weight(), DTensor) and spec_of(weight()).name == "proj.weight"
    assert plan_of_parameters(dict(model.named_parameters())).strategy.value == "fsdp"
    got = dpar.checkpoint.full_state_dict(model)
    assert all(torch.equal(got[k], full[k]) for k in full)
    with pytest.raises(dpar.UnmaterializedStateError, match=r"buffer scale .*model.to_empty"):
        torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(torch.tensor([1, 2]))
    model.scale.fill_(0.5)  # the model's own init of its non-persistent buffer
    torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(torch.tensor([1, 2])).backward()


def test_a_parameter_left_on_meta_is_refused_by_name(one_rank) -> None:
    with torch.device("meta"):
        model = _Tiny()
    dpar.parallelize(model, strategy="zero1")
    with pytest.raises(dpar.UnmaterializedStateError, match=r"parameter emb.weight is still on the meta device.*to_empty"):
        torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(torch.tensor([1, 2]))
