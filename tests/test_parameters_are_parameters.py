"""After ``dpar.parallelize`` a module's parameter attribute is its parameter: writes reach what trains.

See [Note: a parameter is its parameter] (core/model_state.py), [Note: a write the part cannot take as it stands]
(runtime/parameter_writes.py) and [Note: the model's own initializer, called on a parallelized model]
(api/initialization.py). Each write is made the usual way on the module and read back through
``dpar.checkpoint.full_state_dict``, against the same write on the whole model in one process: equal bit for bit,
or a named error with the model unchanged. Then the recipe for a model no rank holds (meta, parallelize,
``to_empty``, the model's own initializer) equal to one device and trained equal to torch DDP, a layer frozen after
``parallelize`` trained as torch DDP with that layer frozen, the guard against training on ``to_empty``'s memory and a
weight tied after ``parallelize`` (tied, or refused by name where tensor parallel placed the two differently), in
the table's launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from distributed import run_ranks

# (strategy, 2-D mesh shape); a (1, 2) mesh puts both ranks on the sharded or tensor axis.
STRATEGIES = (
    ("ddp", None), ("zero1", None), ("zero2", None), ("fsdp", None), ("hsdp", (1, 2)), ("tp", None),
    ("ddp+tp", (1, 2)), ("zero2+tp", (1, 2)), ("fsdp+tp", (1, 2)), ("local_sgd", None),
)
TP_PLAN = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}


# nn.init functions that read the tensor's shape or across its rows without handing themselves to dpar: on a part
# whose shape is not the whole's they may be refused by name (OptionsError) instead of taking effect.
MAY_BE_REFUSED = {"kaiming_uniform_", "xavier_normal_", "orthogonal_"}


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _writes() -> dict[str, object]:
    """The table: each write as a user spells it on the module (under torch.no_grad)."""
    return {
        "requires_grad_": lambda m: m[0].weight.requires_grad_(False),
        "copy_": lambda m: m[2].weight.copy_(torch.full((4, 8), 0.5)),
        "copy_ broadcast": lambda m: m[2].weight.copy_(torch.arange(8.0)),
        "nn.init.zeros_": lambda m: nn.init.zeros_(m[2].bias),
        "fill_": lambda m: m[0].bias.fill_(0.25),
        "mul_": lambda m: m[0].weight.mul_(3.0),
        "reset_parameters": lambda m: (torch.manual_seed(1), m[2].reset_parameters()),
        "apply(reset_parameters)": lambda m: (torch.manual_seed(2), m.apply(
            lambda c: c.reset_parameters() if isinstance(c, nn.Linear) else None)),
        "normal_": lambda m: (torch.manual_seed(3), nn.init.normal_(m[0].weight, std=0.5)),
        "data.uniform_": lambda m: (torch.manual_seed(4), m[0].weight.data.uniform_()),
        "copy_ wrong shape": lambda m: m[2].weight.copy_(torch.ones(3, 8)),
        "kaiming_uniform_": lambda m: (torch.manual_seed(5), nn.init.kaiming_uniform_(m[2].weight, a=0.1)),
        "trunc_normal_": lambda m: (torch.manual_seed(7), nn.init.trunc_normal_(m[0].weight, std=0.3)),
        "xavier_normal_": lambda m: (torch.manual_seed(8), nn.init.xavier_normal_(m[2].weight)),
        "orthogonal_": lambda m: (torch.manual_seed(6), nn.init.orthogonal_(m[0].weight)),
    }


def _mesh(strategy: str, shape: tuple[int, ...] | None):
    from torch.distributed.device_mesh import init_device_mesh

    from dpar.core.plan import Strategy

    if shape is None:
        return None
    return init_device_mesh("cpu", shape, mesh_dim_names=Strategy.parse(strategy).mesh_dim_names)


def _parallelized(strategy: str, shape: tuple[int, ...] | None, model: nn.Module) -> nn.Module:
    import dpar

    kwargs: dict = {"sync_every": 2} if strategy == "local_sgd" else {}
    if "tp" in strategy:
        kwargs["tp_plan"] = TP_PLAN
    return dpar.parallelize(model, strategy=strategy, mesh=_mesh(strategy, shape), **kwargs)


def _table(rank: int, world_size: int) -> dict:
    import dpar

    found = {}
    for strategy, shape in STRATEGIES:
        for name, write in _writes().items():
            model = _parallelized(strategy, shape, _build())
            attribute_is_parameter = model[2].weight is dict(model.named_parameters())["2.weight"]
            before = dpar.checkpoint.full_state_dict(model)
            try:
                with torch.no_grad():
                    write(model)
                error = None
            except Exception as exc:  # noqa: BLE001 (the test reads which)
                error = exc
            after = dpar.checkpoint.full_state_dict(model)
            frozen = not dict(model.named_parameters())["0.weight"].requires_grad
            found[strategy, name] = (attribute_is_parameter, type(error).__name__ if error else None,
                                     isinstance(error, dpar.DparError), before, after, frozen)
    guard = {strategy: _unwritten_after_to_empty(strategy) for strategy in ("fsdp", "tp")}
    ties = {strategy: _tied_after_parallelize(rank, world_size, strategy) for strategy in ("fsdp", "tp")}
    return found, guard, ties


class _TiedLM(nn.Module):
    """An embedding and a head of the same shape, untied when built."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mid, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.mid(self.embed(ids)).relu()).flatten(0, 1), ids.flatten())


def _tied_after_parallelize(rank: int, world_size: int, strategy: str) -> float | str:
    """``model.head.weight = model.embed.weight`` after ``parallelize``, then 5 AdamW steps: the largest difference
    from torch DDP with the same tie, or the dpar error that refused the tie."""
    import torch._dynamo

    import dpar

    torch._dynamo.reset()
    batches = [torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step)) for step in range(5)]
    models = []
    for wrap in ("torch_ddp", strategy):
        torch.manual_seed(0)
        model = _TiedLM()
        if wrap == "torch_ddp":
            model.head.weight = model.embed.weight
            runner = nn.parallel.DistributedDataParallel(model)
        else:
            dpar.parallelize(model, strategy=strategy, example_inputs=(batches[0].chunk(world_size)[rank],))
            try:
                model.head.weight = model.embed.weight
            except dpar.DparError as error:
                return f"{type(error).__name__}: {error}"
            runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in batches:
            optimizer.zero_grad()
            runner(batch.chunk(world_size)[rank]).backward()
            optimizer.step()
        models.append(model)
    want, got = models[0].state_dict(), dpar.checkpoint.full_state_dict(models[1])
    return max((got[k] - want[k]).abs().max().item() for k in want) if rank == 0 else 0.0


def _one_device(name: str) -> tuple[dict[str, torch.Tensor] | None, bool]:
    model = _build()
    try:
        with torch.no_grad():
            _writes()[name](model)
    except RuntimeError:
        return None, False
    return {k: v.clone() for k, v in model.state_dict().items()}, not model[0].weight.requires_grad


def test_every_write_through_a_module_takes_effect_or_is_refused_with_nothing_changed() -> None:
    found, guard, ties = run_ranks(_table, 2, timeout_s=600)[0]
    for strategy, message in guard.items():  # to_empty's memory, never written: refused at the first step
        assert message.startswith("parameter 2.weight was on the meta device"), f"{strategy}: {message}"
        assert "model's own init" in message
    print(f"tied after parallelize: {ties}")
    assert ties["fsdp"] == 0.0, ties  # one parameter under two names, as a tie made before
    assert ties["tp"].startswith("OptionsError: head.weight tied to embed.weight after dpar.parallelize"), ties
    for (strategy, name), (is_parameter, error, named, before, after, frozen) in found.items():
        label = f"{strategy}: {name}"
        assert is_parameter, f"{label}: module.weight is not the parameter named_parameters() yields"
        want, want_frozen = _one_device(name)
        if want is None:  # one device refuses it too (a shape that does not broadcast): refused, nothing changed
            assert error is not None and all(torch.equal(before[k], after[k]) for k in before), label
            assert named or strategy in ("ddp", "zero1", "local_sgd"), f"{label}: refused by {error}, not a dpar error"
            continue
        if name in MAY_BE_REFUSED and error is not None:
            assert named and all(torch.equal(before[k], after[k]) for k in before), f"{label}: {error}, model changed"
            continue
        assert error is None, f"{label}: raised {error}"
        wrong = [k for k in want if not torch.equal(after[k], want[k])]
        assert not wrong, f"{label}: {wrong} differ from the same write on one device"
        assert frozen == want_frozen, label


def _unwritten_after_to_empty(strategy: str) -> str:
    """A meta-born model whose second Linear nothing wrote after to_empty, trained: the error's message."""
    import torch._dynamo

    import dpar

    torch._dynamo.reset()
    with torch.device("meta"):
        model = _build()
    _parallelized(strategy, None, model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model[0].reset_parameters()
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    try:
        runner(torch.ones(2, 8)).sum().backward()
    except dpar.UnmaterializedStateError as error:
        return str(error)
    return "trained"


def _born_on_meta_own_init(rank: int, world_size: int, cases: tuple) -> dict:
    """For each (model, strategy, mesh): built on meta, parallelized, to_empty, the model's own initializer as its
    library calls it, then 5 AdamW steps; beside it the same initializer on the whole model in this process and torch
    DDP trained from that. Returns, per case, the names that differ from one device after the init and the largest
    difference from torch DDP after training (rank 0)."""
    import torch._dynamo

    import dpar
    import third_party as tp

    found = {}
    for name, strategy, shape in cases:
        torch._dynamo.reset()
        one = tp.build(name)
        _own_init(name, one)
        want = {k: v.detach().clone() for k, v in one.state_dict().items()}
        ddp = tp.train(rank, world_size, tp.Run(name, "torch_ddp"), prepare=lambda m: m.load_state_dict(want))
        with torch.device("meta"):
            model = tp.build(name)
        example = tp.rank_slice(tp.global_batch(0, tp.ROWS_PER_RANK * world_size), rank, world_size)
        kwargs = {"mesh": _mesh(strategy, shape)} if shape else {}
        dpar.parallelize(model, strategy=strategy, example_inputs=example, **kwargs)
        model.to_empty(device="cpu")
        _own_init(name, model)
        initialized = dpar.checkpoint.full_state_dict(model)
        trained = tp.train_compiled(rank, world_size, model)
        if rank == 0:
            found[f"{name} {strategy}"] = ([k for k in want if not torch.equal(initialized[k], want[k])],
                                           tp.max_abs_diff(ddp, trained))
        dist.barrier()
    return found


@torch.no_grad()
def _own_init(name: str, model: nn.Module) -> None:
    """The model's own initializer, called as its library's users call it after to_empty, under one seed."""
    torch.manual_seed(1234)
    if name.startswith("titan_"):
        model.inner.init_weights(buffer_device=None)
    else:
        from transformers.initialization import guard_torch_init_functions

        with guard_torch_init_functions():
            model.inner.apply(model.inner._init_weights)


# `-m extended`: HF Llama's fsdp+tp (its 2-D shard of a block is fsdp's and tp's paths together) and torchtitan's
# Llama 3 (its init_weights() is replayed by the same wrapper as HF's _init_weights; dpar.init_weights replays it by
# default in tests/test_init_like_one_device.py).
MODEL_INIT_CASES = (("llama", "fsdp", None), ("llama", "tp", None), ("mixtral", "ep", None))
EXTENDED_INIT_CASES = (("llama", "fsdp+tp", (1, 2)), ("titan_llama3", "fsdp", None))


# Four ranks: fsdp+ep on a (2, 2) ("dp", "ep") mesh, the experts' blocks sharded over dp.
FOUR_RANK_INIT_CASES = (("mixtral", "fsdp+ep", (2, 2)),)


@pytest.mark.parametrize(("cases", "world_size"), [
    (MODEL_INIT_CASES, 2), pytest.param(EXTENDED_INIT_CASES, 2, marks=pytest.mark.extended),
    pytest.param(FOUR_RANK_INIT_CASES, 4, marks=pytest.mark.extended)], ids=["default", "extended", "four_ranks"])
def test_a_model_born_on_meta_initialized_by_its_own_call_equals_one_device_and_trains_as_torch_ddp(
    cases, world_size: int,
) -> None:
    import third_party as tp

    for name, _, _ in cases:
        tp.needs_torchtitan(name)
    found = run_ranks(_born_on_meta_own_init, world_size, cases, timeout_s=900)[0]
    for label, (wrong, _) in found.items():
        assert not wrong, f"{label}: {wrong[:3]} differ from the same initializer on one device"
    tp.assert_figures({label: diff for label, (_, diff) in found.items()}, "own init on meta, 5 AdamW steps vs torch DDP",
                      1e-4, len(cases))


def _frozen_after_parallelize(rank: int, world_size: int, strategy: str, frozen: tuple[str, ...]) -> tuple[dict, dict]:
    """torch DDP with ``frozen`` frozen before the wrap, then dpar with them frozen after ``parallelize`` (as PEFT
    freezes: by name, through ``named_parameters()``): both full state dicts."""
    import dpar
    import third_party as tp

    def freeze(model: nn.Module) -> None:
        for name, param in model.named_parameters():
            if name in frozen:
                param.requires_grad_(False)

    want = tp.train(rank, world_size, tp.Run("llama", "torch_ddp"), prepare=freeze)
    model = tp.build("llama")
    dpar.parallelize(model, strategy=strategy,
                     example_inputs=tp.rank_slice(tp.global_batch(0, tp.ROWS_PER_RANK * world_size), rank, world_size))
    freeze(model)
    return want, tp.train_compiled(rank, world_size, model)


FROZEN = ("inner.model.embed_tokens.weight", "inner.model.layers.0.self_attn.q_proj.weight")


@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("tp", marks=pytest.mark.extended)])
def test_layers_frozen_after_parallelize_train_as_torch_ddp_with_them_frozen(strategy: str) -> None:
    import third_party as tp

    want, got = run_ranks(_frozen_after_parallelize, 2, strategy, FROZEN, timeout_s=600)[0]
    start = tp.build("llama").state_dict()
    for name in FROZEN:
        assert torch.equal(got[name], start[name]), f"{strategy}: frozen {name} moved"
    tp.assert_figures({strategy: tp.max_abs_diff(want, got)}, "frozen after parallelize", 1e-4, 1)
