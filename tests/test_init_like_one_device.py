"""``dpar.init_weights``: a parallelized model's own initializer gives exactly one device's parameters.

For each model and strategy, ``torch.manual_seed(SEED)`` then ``dpar.init_weights(model)`` on the
parallelized model must give, bit for bit, what the same seed and the model's own initializer give the
whole model in one process (Hugging Face ``apply(_init_weights)``; ``reset_parameters`` of every module),
at 2 and 4 ranks, so also world-size invariant. Without it (the initializer run on the parallelized model
as it is) every rank's shard of a weight draws the same numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import third_party
from tests.distributed import run_ranks

SEED = 1234
HF = ("llama", "gpt2", "bert")


class Stack(nn.Module):
    """Layers whose initializer is ``reset_parameters``; 67 and 31 split unevenly over 2 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(third_party.VOCAB, 31)
        self.fc1 = nn.Linear(31, 67)
        self.norm = nn.LayerNorm(67)
        self.fc2 = nn.Linear(67, third_party.VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.fc2(self.norm(self.fc1(self.emb(ids)).relu()))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return Stack() if name == "stack" else third_party.build(name)


def _custom(module: nn.Module) -> None:
    """A user's initializer, applied per module: reads the config-like shape, draws, writes part of a weight."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=module.weight.shape[1] ** -0.5)
        module.weight[:, 0].zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.uniform_(-1.0, 1.0)


@torch.no_grad()
def _one_device(name: str) -> dict[str, torch.Tensor]:
    """The model's own initializer on the whole model in one process, called as its library calls it."""
    model = _build(name.removesuffix("+custom"))
    torch.manual_seed(SEED)
    if name.endswith("+custom"):
        model.apply(_custom)
    elif name == "stack":
        model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    elif name.startswith("titan_"):
        model.inner.init_weights(buffer_device=None)
    else:
        from transformers.initialization import guard_torch_init_functions

        with guard_torch_init_functions():
            model.inner.apply(model.inner._init_weights)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _differences(found: dict, expected: dict) -> list[str]:
    wrong = [k for k in expected if k not in found or not torch.equal(found[k], expected[k])]
    return wrong + [k for k in found if k not in expected]


def _parallelized(rank: int, world_size: int, model: nn.Module, strategy: str, mesh_shape: tuple[int, ...] | None):
    import dpar
    from torch.distributed.device_mesh import init_device_mesh

    kwargs = {"sync_every": 2} if strategy == "local_sgd" else {}
    if mesh_shape is not None:
        names = ("replicate", "shard") if strategy == "hsdp" else ("dp", "ep") if strategy.endswith("+ep") else ("dp", "tp")
        kwargs["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    rows = third_party.ROWS_PER_RANK * world_size
    example = third_party.rank_slice(third_party.global_batch(0, rows), rank, world_size)
    dpar.parallelize(model, strategy=strategy, example_inputs=example, **kwargs)
    return model


def _cases(rank: int, world_size: int, cases: list[tuple[str, str, tuple[int, ...] | None]]) -> dict[str, object]:
    """Each case's names of entries that differ from one device (rank 0), and the refusals' messages."""
    import dpar

    found: dict[str, object] = {}
    references = {name: _one_device(name.removeprefix("meta:")) for name in {c[0] for c in cases}}
    for name, strategy, mesh_shape in cases:
        born_on_meta = name.startswith("meta:")  # the recipe: meta, parallelize, to_empty, init
        with torch.device("meta" if born_on_meta else "cpu"):
            model = _build(name.removeprefix("meta:").removesuffix("+custom"))
        model = _parallelized(rank, world_size, model, strategy, mesh_shape)
        if born_on_meta:
            model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        dpar.init_weights(model, _custom if name.endswith("+custom") else None)
        state = dpar.checkpoint.full_state_dict(model)
        if rank == 0:
            found[f"{name}/{strategy}"] = _differences(state, references[name])
    # A write through a reference taken before parallelize cannot reach the shard: refused by name.
    model = _build("stack")
    before = model.fc1.weight
    _parallelized(rank, world_size, model, "fsdp", None)
    try:
        dpar.init_weights(model, lambda m: before.normal_() if isinstance(m, nn.Linear) else None)
        found["stale reference"] = "not refused"
    except dpar.InitializationError as exc:
        found["stale reference"] = str(exc)
    # Ranks seeded differently would initialize their parts from different streams: refused by name.
    torch.manual_seed(SEED + rank)
    try:
        dpar.init_weights(model)
        found["seeds"] = "not refused"
    except dpar.InitializationError as exc:
        found["seeds"] = str(exc)
    # A parameter replaced since parallelize (to_empty without swapping) is no shard dpar knows: refused by name.
    model.fc1._parameters["weight"] = nn.Parameter(torch.empty(67, 31))
    torch.manual_seed(SEED)
    try:
        dpar.init_weights(model)
        found["replaced"] = "not refused"
    except dpar.InitializationError as exc:
        found["replaced"] = str(exc)
    return found


def _check(found: dict[str, object], world_size: int) -> None:
    assert {k: v for k, v in found.items() if isinstance(v, list) and v} == {}
    assert found["stale reference"].startswith("the initializer of module fc1 wrote in place"), found["stale reference"]
    assert f"ranks {list(range(1, world_size))} differ" in found["seeds"], found["seeds"]
    assert found["replaced"].startswith("fc1.weight was parallelized by dpar.parallelize"), found["replaced"]


# fsdp+tp at 2 ranks: a (1, 2) mesh; the 4-rank test has the (2, 2) one.
TWO_RANKS = [
    (name, strategy, (1, 2) if strategy == "fsdp+tp" else None)
    for name in ("stack", "stack+custom", *HF)
    for strategy in ("ddp", "fsdp", "zero2", "tp", "fsdp+tp")
] + [("meta:llama", "fsdp", None), ("meta:llama", "tp", None), ("meta:llama", "fsdp+tp", (1, 2)),
      ("mixtral", "ep", None), ("meta:qwen3_moe", "ep", None)]
FOUR_RANKS = [
    ("gpt2", "fsdp", None), ("gpt2", "hsdp", (2, 2)), ("gpt2", "ddp+tp", (2, 2)), ("gpt2", "fsdp+tp", (2, 2)),
    ("stack", "zero1", None), ("stack", "local_sgd", None), ("stack", "zero2+tp", (2, 2)),
    ("meta:mixtral", "ep", None), ("qwen3_moe", "ddp+ep", (2, 2)),
]
TORCHTITAN = [("titan_llama3", "fsdp+tp", (1, 2))]


def test_init_weights_equals_one_device_at_two_ranks() -> None:
    _check(run_ranks(_cases, 2, TWO_RANKS, timeout_s=240)[0], 2)


@pytest.mark.extended  # the two-rank case's path on more shards
def test_init_weights_equals_one_device_at_four_ranks() -> None:
    """The same numbers at 4 ranks as at 2 and on one device: the 2-D meshes, replicated and local-SGD strategies."""
    _check(run_ranks(_cases, 4, FOUR_RANKS, timeout_s=240)[0], 4)


def test_init_weights_torchtitan_model() -> None:
    """torchtitan's own ``init_weights()``: one call from the model's root, tied-style reassignments, buffers."""
    third_party.needs_torchtitan("titan_llama3")
    _check(run_ranks(_cases, 2, TORCHTITAN, timeout_s=240)[0], 2)
