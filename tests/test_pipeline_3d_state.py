"""The state of a pipeline with tensor parallel inside its stages, born on meta: weights in from a full state
dict, trained, saved in shards, resumed, and resharded to and from the other strategies.

(pp 2, tp 2) on 4 gloo ranks, HF Llama: each rank holds its stage's tp blocks only. Anchors: the weights given
(exact), torch DDP from the same weights (5 AdamW steps, <= 1e-4), the saved state itself for every round trip
(exact), and a resumed run against the one that kept going (exact). See [Note: tensor parallel inside a pipeline
stage] in compiler/pipeline_parallel/stage_graphs.py and [Note: a pipelined model's state] in api/pipelining.py.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import dpar
from distributed import run_ranks
from test_pipeline_born_sharded import (LAYERS, TOLERANCE, _diff, _exact, _init_rotary, _optimizer_state, _slice,
                                        _torch_ddp, _train, _weights, fsdp_loaded_from)
from pipeline_training import build, optimizer, token_loss


def _tp_pipeline_on_meta(rank: int, world_size: int) -> tuple[nn.Module, object]:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    warnings.simplefilter("ignore", UserWarning)  # DTensor's notes on gathering
    torch._dynamo.reset()
    with torch.device("meta"):
        model = build("llama", LAYERS)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    step = dpar.pipeline(model, token_loss, example_inputs=_slice(0, rank, world_size), stages=2, micro_batches=4,
                         mesh=mesh)
    model.to_empty(device="cpu")
    return model, step


def _held_elements(model: nn.Module) -> int:
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def _state_in_and_out(rank: int, world_size: int, dirs: dict[str, str], weights: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    found: dict = {}
    model, step = _tp_pipeline_on_meta(rank, world_size)
    found["held elements"] = _held_elements(model)
    set_model_state_dict(model, dict(weights) if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _init_rotary(model)
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["full state dict in"] = _exact(got, weights)
    opt = _train(model, step, rank, world_size)
    trained = dpar.checkpoint.full_state_dict(model)
    want, want_opt = _torch_ddp(weights, rank, world_size)
    if rank == 0:
        found["vs torch ddp"] = _diff(trained, want.state_dict())
        found["trained"] = trained
    dpar.checkpoint.save(model, opt, dirs["3d"])
    dpar.checkpoint.save(want, want_opt, dirs["ddp"])

    # Resume: a new (pp 2, tp 2) pipeline born on meta loads the checkpoint, then both take the same step.
    resumed, resumed_step = _tp_pipeline_on_meta(rank, world_size)
    _init_rotary(resumed)
    resumed_opt = optimizer("adamw", resumed.parameters())
    dpar.checkpoint.load(resumed, resumed_opt, dirs["3d"])
    got = dpar.checkpoint.full_state_dict(resumed)
    found["optimizer resumed"] = _exact(_optimizer_state(resumed, resumed_opt), _optimizer_state(model, opt))
    if rank == 0:
        found["3d -> 3d"] = _exact(got, trained)
    for m, s, o in ((model, step, opt), (resumed, resumed_step, resumed_opt)):
        s(*_slice(5, rank, world_size))
        o.step()
        o.zero_grad()
    after, resumed_after = dpar.checkpoint.full_state_dict(model), dpar.checkpoint.full_state_dict(resumed)
    if rank == 0:
        found["resumed step"] = _exact(after, resumed_after)

    # torch DDP -> (pp 2, tp 2): DDP's model and AdamW state, saved by dpar.checkpoint.
    from_ddp, _ = _tp_pipeline_on_meta(rank, world_size)
    _init_rotary(from_ddp)
    from_ddp_opt = optimizer("adamw", from_ddp.parameters())
    dpar.checkpoint.load(from_ddp, from_ddp_opt, dirs["ddp"])
    got = dpar.checkpoint.full_state_dict(from_ddp)
    if rank == 0:
        found["ddp 4 -> 3d"] = _exact(got, want.state_dict())
    # ... and back: saved from (pp 2, tp 2) and loaded into a plain model, as DDP's ranks hold it. The optimizer
    # state, split into tp blocks on the way in, comes out whole and equal to DDP's.
    dpar.checkpoint.save(from_ddp, from_ddp_opt, dirs["back"])
    plain = build("llama", LAYERS)
    plain_opt = optimizer("adamw", plain.parameters())
    dpar.checkpoint.load(plain, plain_opt, dirs["back"])
    found["ddp 4 -> 3d -> ddp 4"] = _exact(dict(plain.state_dict()), dict(want.state_dict()))
    found["ddp 4 -> 3d -> ddp 4 optimizer"] = _exact(_optimizer_state(plain, plain_opt), _optimizer_state(want, want_opt))

    # (pp 2, tp 2) -> fsdp 4 (dpar.parallelize on meta).
    fsdp, _ = fsdp_loaded_from(dirs["3d"], rank, world_size)
    got = dpar.checkpoint.full_state_dict(fsdp)
    if rank == 0:
        found["3d -> fsdp 4"] = _exact(got, trained)
    dist.barrier()
    return found


def test_a_tp_pipeline_born_on_meta_loads_trains_saves_resumes_and_reshards(tmp_path) -> None:
    dirs = {name: str(tmp_path / name) for name in ("3d", "ddp", "back")}
    weights = _weights()
    total = sum(v.numel() for k, v in build("llama", LAYERS).named_parameters())
    results = run_ranks(_state_in_and_out, 4, dirs, weights, timeout_s=600)
    first = results[0]
    for rank, result in enumerate(results):
        assert result["held elements"] < total / 2, rank  # its stage's blocks: under half the model
        assert result["optimizer resumed"], rank
        assert result["ddp 4 -> 3d -> ddp 4"] and result["ddp 4 -> 3d -> ddp 4 optimizer"], rank
    assert first["full state dict in"]
    assert first["vs torch ddp"] < TOLERANCE
    assert first["3d -> 3d"] and first["resumed step"]
    assert first["ddp 4 -> 3d"]
    assert first["3d -> fsdp 4"]
