"""What dpar knows about a model survives the ways torch replaces its parameters after training has started.

Two AdamW steps, then one of:
- ``assign``: ``model.load_state_dict(weights, assign=True)`` puts new Parameter objects in place. As torch's
  ``load_state_dict`` documents, an optimizer built before holds the old ones: the user builds a new one over
  ``model.parameters()`` and gives it the old one's ``state_dict()`` (what torch DDP and FSDP2 need too);
- ``swap``: ``torch.utils.swap_tensors`` on every parameter (what ``to_empty`` and ``module._apply`` do under
  ``torch.__future__.set_swap_module_params_on_conversion(True)``): same Python objects, new storage, here with
  new values (halved; torch DDP's parameters are halved in place at the same step);
- ``checkpoint``: ``dpar.checkpoint.save``, then a fresh model born on meta, parallelized, ``to_empty``,
  ``dpar.checkpoint.load`` into it and a new optimizer;
then three more steps. The parameters must equal torch DDP's after the same five steps (and the same halving).
See [Note: facts keyed by name, not by tensor] in core/model_state.py.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dpar
from distributed import run_ranks

TOLERANCE = 1e-4
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp")
WAYS = ("assign", "swap", "checkpoint")
# ddp's and zero2's checkpoints into a meta-born model are test_born_sharded's and test_reshard's cases.
CASES = [(s, w) for s in STRATEGIES for w in WAYS if not (w == "checkpoint" and s in ("ddp", "zero2"))]
# zero2 holds its parameters as ddp does and its gradients as fsdp does, zero1 its optimizer state in ranges as
# fsdp holds its shards, ddp its parameters whole as tp does its unsplit ones: `-m extended`.
# Assigning a new Parameter is the simplest replacement; swap covers fsdp and tp by default, checkpoint fsdp (tp's
# checkpoint loads are test_tensor_parallel_state_dict's).
EXTENDED = [c for c in CASES if c[0] in ("zero1", "zero2", "ddp") or c[1] == "assign" or c == ("tp", "checkpoint")]
BEFORE = 2  # steps before the parameters are replaced


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    import third_party as tp

    return tp.rank_slice(tp.global_batch(step, tp.ROWS_PER_RANK * world_size), rank, world_size)


def _parallelized(strategy: str, rank: int, world_size: int, meta: bool = False) -> nn.Module:
    import third_party as tp

    if meta:
        with torch.device("meta"):
            model = tp.build("llama")
    else:
        model = tp.build("llama")
    dpar.parallelize(model, strategy=strategy, example_inputs=_batch(0, rank, world_size))
    if meta:
        model.to_empty(device="cpu")
        for module in model.modules():  # the model's own init of its non-persistent rotary buffers
            if "RotaryEmbedding" in type(module).__name__:
                model.inner._init_weights(module)
    return model


def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _train(strategy: str, way: str, rank: int, world_size: int, checkpoint_dir: str) -> dict[str, torch.Tensor]:
    import third_party as tp

    model = _parallelized(strategy, rank, world_size)
    runner, optimizer = _compiled(model), _adamw(model)
    for step in range(tp.STEPS):
        if step == BEFORE:
            if way == "assign":
                saved = optimizer.state_dict()
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                model.load_state_dict(weights, assign=True)
                if strategy == "zero1":  # the old optimizer would step parameters the model no longer holds
                    with pytest.raises(dpar.OptionsError, match=r"zero1 parameter .* was replaced .*state_dict\(\)"):
                        optimizer.step()
                optimizer = _adamw(model)
                optimizer.load_state_dict(saved)
            elif way == "swap":
                for p in list(model.parameters()):
                    torch.utils.swap_tensors(p, nn.Parameter(p.detach() * 0.5, requires_grad=p.requires_grad))
            else:
                dpar.checkpoint.save(model, optimizer, checkpoint_dir)
                model = _parallelized(strategy, rank, world_size, meta=True)
                optimizer = _adamw(model)
                dpar.checkpoint.load(model, optimizer, checkpoint_dir)
                runner = _compiled(model)
        optimizer.zero_grad()
        runner(*_batch(step, rank, world_size)).backward()
        optimizer.step()
    return dpar.checkpoint.full_state_dict(model)


def _torch_ddp(rank: int, world_size: int, halve: bool) -> dict[str, torch.Tensor]:
    """torch DDP's five steps, its parameters halved in place after the first two with ``halve``."""
    import third_party as tp

    model = tp.build("llama")
    runner, optimizer = nn.parallel.DistributedDataParallel(model), _adamw(model)
    for step in range(tp.STEPS):
        if step == BEFORE and halve:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        optimizer.zero_grad()
        runner(*_batch(step, rank, world_size)).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _every_case(rank: int, world_size: int, directory: str, cases: list[tuple[str, str]]) -> dict[str, float | str]:
    import torch._dynamo

    import third_party as tp

    want = {halve: _torch_ddp(rank, world_size, halve) for halve in (False, True)}
    found: dict[str, float | str] = {}
    for strategy, way in cases:
        torch._dynamo.reset()
        label = f"{strategy} {way}"
        started = time.perf_counter()
        try:
            got = _train(strategy, way, rank, world_size, f"{directory}/{strategy}")
            found[label] = tp.max_abs_diff(want[way == "swap"], got) if rank == 0 else 0.0
        except Exception as exc:  # recorded per case: one failure must not hide the others' figures
            found[label] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if rank == 0:
            print(f"{label}: {found[label]} ({time.perf_counter() - started:.1f} s)", flush=True)
        dist.barrier()
    return found


@pytest.mark.parametrize("cases", [[c for c in CASES if c not in EXTENDED], pytest.param(EXTENDED, marks=pytest.mark.extended)],
                         ids=["default", "extended"])
def test_parameters_replaced_after_training_started_train_as_torch_ddp(tmp_path, cases: list[tuple[str, str]]) -> None:
    import third_party as tp

    found = run_ranks(_every_case, 2, str(tmp_path), cases, timeout_s=900)[0]
    tp.assert_figures(found, "replaced after 2 steps", TOLERANCE, len(cases))
