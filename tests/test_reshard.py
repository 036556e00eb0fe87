"""Checkpoints reshard between strategies and world sizes, and torch's full-state-dict load works under the 2-D ones.

Reshards through ``dpar.checkpoint.save`` / ``load`` (HF Llama, 2 layers): tp 2 -> fsdp 4, fsdp+tp (2x2) -> ddp 2,
zero2 4 -> tp 2, fsdp 2 -> a plain one-process model, tp 2 -> zero1 2 (the weights alone: zero1's optimizer state is
each rank's range, which another strategy's checkpoint does not hold, so with the optimizer a named CheckpointError). Parameters and
AdamW's moments and step are compared with ``torch.equal`` at their full shapes on both sides. The source state is
two AdamW steps on gradients that are an elementwise function of each parameter (``sin``), so every layout steps the
same numbers without a compile.

The 2-D strategies (4 ranks, mesh 2x2 and an uneven tiny stack): ``set_model_state_dict(full_state_dict=True,
broadcast_from_rank0=True)`` into a model born on meta equals the full state dict exactly, and (fsdp+tp) 5 AdamW
steps then match torch DDP (see [Note: a 2-D parameter in torch's full-state-dict load] in surgery/tensor_parallel.py).

One ``run_ranks`` call at 2 ranks saves, one at 4 loads and saves, one at 2 loads what 4 saved.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import dpar
from distributed import run_ranks

TOLERANCE = 1e-4


def _llama(seed: int) -> nn.Module:
    import third_party as tp

    model = tp.build("llama")  # seeds 0; reseed and redraw so a loaded model starts elsewhere
    if seed:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
    return model


def _parallelized(strategy: str | None, rank: int, world_size: int, mesh_shape: tuple[int, int] | None = None, seed: int = 0):
    import third_party as tp
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = _llama(seed)
    if strategy is not None:
        kwargs = {}
        if mesh_shape is not None:
            kwargs["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        example = tp.rank_slice(tp.global_batch(0, tp.ROWS_PER_RANK * world_size), rank, world_size)
        dpar.parallelize(model, strategy=strategy, example_inputs=example, **kwargs)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


def _stepped(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    """AdamW steps on gradients that are an elementwise function of each parameter: the same numbers under any layout."""
    for _ in range(steps):
        for p in model.parameters():
            p.grad = p.detach().sin()
        optimizer.step()


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor] | None:
    """Parameters and optimizer state at full shape, keyed by name (rank 0; None elsewhere)."""
    from dpar.runtime.checkpoint import _optimizer_state_by_name

    full = dict(dpar.checkpoint.full_state_dict(model) or {})
    module = getattr(model, "_orig_mod", model)
    for name, state in _optimizer_state_by_name(module, optimizer)["state"].items():
        for key, value in state.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            full[f"optimizer.{name}.{key}"] = value.detach().to("cpu", copy=True)
    return full if not dist.is_initialized() or dist.get_rank() == 0 else None


def _differences(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> str | int:
    """0 where every tensor is equal; else the first differences, named."""
    if want.keys() != got.keys():
        return f"keys differ: {sorted(set(want) ^ set(got))[:4]}"
    differ = [k for k in want if want[k].shape != got[k].shape or not torch.equal(want[k], got[k])]
    return f"{len(differ)} differ: {differ[:4]}" if differ else 0


def _saved(strategy: str, rank: int, world_size: int, directory: str, mesh_shape=None) -> dict | None:
    model, optimizer = _parallelized(strategy, rank, world_size, mesh_shape)
    _stepped(model, optimizer)
    dpar.checkpoint.save(model, optimizer, directory)
    return _full_state(model, optimizer)


def _loaded(strategy: str | None, rank: int, world_size: int, directory: str, want: dict | None, mesh_shape=None):
    model, optimizer = _parallelized(strategy, rank, world_size, mesh_shape, seed=1)
    dpar.checkpoint.load(model, optimizer, directory)
    got = _full_state(model, optimizer)
    return (_differences(want, got) if got is not None else None), model, optimizer


def _two_ranks_first(rank: int, world_size: int, root: str) -> dict:
    found: dict = {"saved": {}}
    for strategy in ("tp", "fsdp"):
        found["saved"][strategy] = _saved(strategy, rank, world_size, os.path.join(root, f"{strategy}2"))
    # tp 2 -> zero1 2: zero1 keeps each rank's range of the optimizer state, which a tp checkpoint does not hold:
    # refused by name with the optimizer (nothing loaded); its weights, whole on every rank, load alone.
    model, optimizer = _parallelized("zero1", rank, world_size, seed=1)
    before = _full_state(model, optimizer)
    try:
        dpar.checkpoint.load(model, optimizer, os.path.join(root, "tp2"))
        found["tp 2 -> zero1 2 with optimizer"] = "loaded"
    except dpar.CheckpointError as error:
        after = _full_state(model, optimizer)
        found["tp 2 -> zero1 2 with optimizer"] = str(error) if rank or _differences(before, after) == 0 else "changed"
    dpar.checkpoint.load(model, None, os.path.join(root, "tp2"))
    weights = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        want = {k: v for k, v in found["saved"]["tp"].items() if not k.startswith("optimizer.")}
        found["tp 2 -> zero1 2 weights"] = _differences(want, weights)
    return found


def _born_on_meta_loaded_by_torch(rank: int, world_size: int, strategy: str, full: dict, want: dict | None) -> tuple:
    """(exact difference after set_model_state_dict, max |diff| from torch DDP after 5 AdamW steps, unless
    ``want`` is None)."""
    import third_party as tp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    with torch.device("meta"):
        model = tp.build("llama")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    example = tp.rank_slice(tp.global_batch(0, tp.ROWS_PER_RANK * world_size), rank, world_size)
    dpar.parallelize(model, strategy=strategy, example_inputs=example, mesh=mesh)
    model.to_empty(device="cpu")
    for module in model.modules():  # the rotary buffers (not in any state dict): the model's own init
        if "RotaryEmbedding" in type(module).__name__:
            model.inner._init_weights(module)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(full) if rank == 0 else {}, options=options)
    loaded = dpar.checkpoint.full_state_dict(model)
    exact = _differences(full, loaded) if rank == 0 else None
    if want is None:
        return exact, None
    trained = tp.train_compiled(rank, world_size, model)
    return exact, (tp.max_abs_diff(want, trained) if rank == 0 else None)


class _Uneven(nn.Module):
    """Widths 2 tensor-parallel ranks and then 2 data-parallel ranks split unevenly (7 rows: 4 + 3, then 2 + 2, 2 + 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 7)
        self.down = nn.Linear(7, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).square().mean()


def _uneven_loaded_by_torch(rank: int, strategy: str) -> str | int | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    full = _Uneven().state_dict()
    with torch.device("meta"):
        model = _Uneven()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dpar.parallelize(model, strategy=strategy, mesh=mesh, tp_plan={"up.weight": 0, "up.bias": 0, "down.weight": 1})
    model.to_empty(device="cpu")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(full) if rank == 0 else {}, options=options)
    loaded = dpar.checkpoint.full_state_dict(model)
    return _differences(dict(full), loaded) if rank == 0 else None


def _four_ranks(rank: int, world_size: int, root: str, tp2: dict | None) -> dict:
    import third_party as tp

    found: dict = {"saved": {}}
    started = time.perf_counter()
    found["tp 2 -> fsdp 4"] = _loaded("fsdp", rank, world_size, os.path.join(root, "tp2"), tp2)[0]
    found["saved"]["fsdp+tp"] = _saved("fsdp+tp", rank, world_size, os.path.join(root, "fsdp+tp2x2"), (2, 2))
    found["saved"]["zero2"] = _saved("zero2", rank, world_size, os.path.join(root, "zero2_4"))
    found["seconds: reshards"] = time.perf_counter() - started
    torch.manual_seed(0)
    full = {k: v.detach().clone() for k, v in tp.build("llama").state_dict().items()}
    want = tp.train(rank, world_size, tp.Run("llama", "torch_ddp"), prepare=lambda m: m.load_state_dict(full))
    for strategy in ("fsdp+tp", "zero2+tp"):  # zero2+tp loaded only: it trains as fsdp+tp's dp shards do
        started = time.perf_counter()
        exact, trained = _born_on_meta_loaded_by_torch(rank, world_size, strategy, full,
                                                       want if strategy == "fsdp+tp" else None)
        found[f"{strategy} 2x2 set_model_state_dict"] = exact
        found[f"{strategy} 2x2 trained vs torch DDP"] = trained
        found[f"{strategy} 2x2 uneven set_model_state_dict"] = _uneven_loaded_by_torch(rank, strategy)
        found[f"seconds: {strategy}"] = time.perf_counter() - started
    dist.barrier()
    return found


def _two_ranks_last(rank: int, world_size: int, root: str, fsdp_tp: dict | None, zero2: dict | None) -> dict:
    return {
        "fsdp+tp 2x2 -> ddp 2": _loaded("ddp", rank, world_size, os.path.join(root, "fsdp+tp2x2"), fsdp_tp)[0],
        "zero2 4 -> tp 2": _loaded("tp", rank, world_size, os.path.join(root, "zero2_4"), zero2)[0],
    }


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("reshard"))
    first = run_ranks(_two_ranks_first, 2, root, timeout_s=300)[0]
    four = run_ranks(_four_ranks, 4, root, first["saved"]["tp"], timeout_s=400)[0]
    last = run_ranks(_two_ranks_last, 2, root, four["saved"]["fsdp+tp"], four["saved"]["zero2"], timeout_s=300)[0]
    # fsdp 2 -> one plain process, no process group.
    model = _llama(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dpar.checkpoint.load(model, optimizer, os.path.join(root, "fsdp2"))
    plain = {"fsdp 2 -> one process": _differences(first["saved"]["fsdp"], _full_state(model, optimizer))}
    results = {k: v for part in (first, four, last, plain) for k, v in part.items() if k != "saved"}
    for label, value in results.items():
        print(f"reshard: {label}: {value}")
    return results


@pytest.mark.parametrize("case", [
    "tp 2 -> fsdp 4", "fsdp+tp 2x2 -> ddp 2", "zero2 4 -> tp 2", "fsdp 2 -> one process", "tp 2 -> zero1 2 weights",
])
def test_checkpoint_reshards_exactly(found: dict, case: str) -> None:
    assert found[case] == 0, found[case]


def test_zero1_refuses_another_strategys_optimizer_state_by_name_and_unchanged(found: dict) -> None:
    message = found["tp 2 -> zero1 2 with optimizer"]
    assert "zero1 keeps a state per rank" in message and "optimizer=None" in message, message


@pytest.mark.parametrize("strategy", ["fsdp+tp", "zero2+tp"])
def test_torch_full_state_dict_load_under_two_dimensional_strategies(found: dict, strategy: str) -> None:
    assert found[f"{strategy} 2x2 set_model_state_dict"] == 0
    assert found[f"{strategy} 2x2 uneven set_model_state_dict"] == 0
    if strategy == "fsdp+tp":
        assert found[f"{strategy} 2x2 trained vs torch DDP"] <= TOLERANCE
