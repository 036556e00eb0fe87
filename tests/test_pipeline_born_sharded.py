"""``dpar.pipeline`` models born on the meta device: trained, initialized, loaded, saved and resharded.

``with torch.device("meta"): build()`` -> ``dpar.pipeline`` -> ``to_empty`` -> weights in (``set_model_state_dict``
broadcast from rank 0, ``dcp.load``, ``dpar.checkpoint.load``, ``load_safetensors``) or ``dpar.init_weights`` -> train.
Anchors: torch DDP from the same weights (5 AdamW steps, <= 1e-4), one device's init (exact), and the saved state
itself for every round trip (exact). See [Note: a pipeline born on meta] and [Note: a pipelined model's state] in
api/pipelining.py. One ``run_ranks`` call per world size, every case inside it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import dpar
from distributed import run_ranks
from pipeline_training import ROWS_PER_RANK, STEPS, batch, build, optimizer, token_loss

TOLERANCE = 1e-4
LAYERS = 2
SEED = 7


def _weights(name: str = "llama") -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build(name, LAYERS).state_dict().items()}


def _one_device_init(name: str = "llama") -> dict[str, torch.Tensor]:
    model = build(name, LAYERS)
    torch.manual_seed(SEED)
    dpar.init_weights(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _own_init(model: nn.Module) -> None:
    """The model's own initializer called directly, as an HF user calls it after to_empty (see [Note: the model's
    own initializer, called on a parallelized model] in api/initialization.py)."""
    from transformers.initialization import guard_torch_init_functions

    torch.manual_seed(SEED)
    with torch.no_grad(), guard_torch_init_functions():
        model.inner.apply(model.inner._init_weights)


def _slice(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step, ROWS_PER_RANK * world_size)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def _init_rotary(model: nn.Module) -> None:
    """The model's own init of its non-persistent rotary buffer, as an HF user runs it after to_empty."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            model.inner._init_weights(module)


def _born_on_meta(
    rank: int, world_size: int, mesh_shape: tuple[int, int] | None, name: str = "llama", **options: Any
) -> tuple[nn.Module, object]:
    """A pipelined model built on meta and materialized on CPU: nothing but its stages was ever allocated.
    ``options``: more of dpar.pipeline's."""
    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    torch._dynamo.reset()
    with torch.device("meta"):
        model = build(name, LAYERS)
    mesh, dp_strategy = None, "ddp"
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh, dp_strategy = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "pp")), "fsdp"
    step = dpar.pipeline(model, token_loss, example_inputs=_slice(0, rank, world_size), stages=2, micro_batches=4,
                         mesh=mesh, dp_strategy=dp_strategy, **options)
    held = {n for s in step.graphs for n in step.split.stages[s].parameters}
    params = dict(model.named_parameters(remove_duplicate=False))  # another stage's parameters are not in the model
    assert all(any(params.get(m) is p for m in held) for p in params.values())
    model.to_empty(device="cpu")
    return model, step


def _no_bare_tensors(model: nn.Module, dp: bool) -> None:
    """Each rank's state dict: its stages' parameters, whole or (fsdp over dp) as DTensors of the whole shape."""
    whole = model._dpar_pipeline.whole_model()
    for name, value in model.state_dict().items():
        assert tuple(value.shape) == tuple(whole[name][0]), name
        assert value.numel() > 0, name
        if dp and name in dict(model.named_parameters()):
            assert isinstance(value, DTensor), name


def _train(model: nn.Module, step, rank: int, world_size: int) -> torch.optim.Optimizer:
    opt = optimizer("adamw", model.parameters())
    for i in range(STEPS):
        step(*_slice(i, rank, world_size))
        opt.step()
        opt.zero_grad()
    return opt


def _torch_ddp(weights: dict[str, torch.Tensor], rank: int, world_size: int, name: str = "llama"
               ) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.nn.parallel import DistributedDataParallel

    model = build(name, LAYERS)
    model.load_state_dict(weights)
    ddp = DistributedDataParallel(model)
    opt = optimizer("adamw", model.parameters())
    for i in range(STEPS):
        x, y = _slice(i, rank, world_size)
        token_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's optimizer state by parameter name, whole (a DTensor's all-gathered: a collective over dp)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for group in opt.param_groups:
        for p in group["params"]:
            entry = opt.state[p]
            state[names[id(p)]] = {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in entry.items()
            }
    return state


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _exact(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    return all(_exact(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


def fsdp_loaded_from(checkpoint: str, rank: int, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A Llama sharded by ``dpar.parallelize(strategy="fsdp")`` on meta, then ``checkpoint`` loaded into it and AdamW."""
    torch._dynamo.reset()
    with torch.device("meta"):
        fsdp = build("llama", LAYERS)
    dpar.parallelize(fsdp, strategy="fsdp", example_inputs=(_slice(0, rank, world_size)[0],))
    fsdp.to_empty(device="cpu")
    _init_rotary(fsdp)
    fsdp_opt = optimizer("adamw", fsdp.parameters())
    dpar.checkpoint.load(fsdp, fsdp_opt, checkpoint)
    return fsdp, fsdp_opt


def _loaded_trained_saved(rank: int, world_size: int, mesh: tuple[int, int] | None, weights: dict,
                          checkpoint: str, safetensors: str) -> tuple[dict, nn.Module, Any, Any, Any]:
    """Born on meta, rank 0's weights broadcast, 5 AdamW steps against torch DDP, saved (DCP and safetensors)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    found: dict = {}
    model, step = _born_on_meta(rank, world_size, mesh)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(weights) if rank == 0 else {}, options=options)
    _init_rotary(model)
    _no_bare_tensors(model, dp=mesh is not None)
    opt = _train(model, step, rank, world_size)
    want, want_opt = _torch_ddp(weights, rank, world_size)
    trained = dpar.checkpoint.full_state_dict(model)
    dpar.checkpoint.save(model, opt, checkpoint)
    dpar.checkpoint.save_safetensors(model, safetensors)
    found["optimizer"] = _optimizer_state(model, opt)
    if rank == 0:
        found["vs torch ddp"] = _diff(trained, want.state_dict())
        found["trained"] = trained
        found["safetensors out"] = _exact(load_file(os.path.join(safetensors, "model.safetensors")), trained)
    return found, model, opt, want, want_opt


def _four(rank: int, world_size: int, dirs: dict[str, str], weights: dict, init: dict) -> dict:
    """dp 2 x pp 2, fsdp over dp: broadcast load + train vs torch DDP, save (DCP, safetensors), init, safetensors in."""
    found, *_ = _loaded_trained_saved(rank, world_size, (2, 2), weights, dirs["pp_fsdp"], dirs["st_fsdp"])
    model, step = _born_on_meta(rank, world_size, (2, 2))
    torch.manual_seed(SEED)
    dpar.init_weights(model)
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["init"] = _exact(got, init)
    _own_init(model)
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["own init"] = _exact(got, init)
    dpar.checkpoint.load_safetensors(model, dirs["st_plain"])  # each rank reads its stage's rows of the file
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["safetensors in"] = _exact(got, weights)
    dist.barrier()
    return found


def _two(rank: int, world_size: int, dirs: dict[str, str], weights: dict, init: dict, four: dict,
         gpt2_weights: dict, gpt2_init: dict) -> dict:
    """pp 2: broadcast load + train vs torch DDP, save; init; safetensors in and out; dcp.load; ddp 2 -> pp 2;
    pp 2 x dp 2 (fsdp) -> fsdp 2."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    found, model, opt, want, want_opt = _loaded_trained_saved(rank, world_size, None, weights, dirs["pp"], dirs["st_pp"])
    # ddp 2 -> pp 2: torch DDP's model and AdamW, saved by dpar.checkpoint, loaded into a pipeline born on meta.
    dpar.checkpoint.save(want, want_opt, dirs["ddp"])
    dcp.save(want.state_dict(), checkpoint_id=dirs["dcp"])  # a plain model's DCP checkpoint

    model, step = _born_on_meta(rank, world_size, None)
    torch.manual_seed(SEED)
    dpar.init_weights(model)
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["init"] = _exact(got, init)
    _own_init(model)
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["own init"] = _exact(got, init)
    dpar.checkpoint.load_safetensors(model, dirs["st_plain"])
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["safetensors in"] = _exact(got, weights)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=dirs["dcp"])  # DCP loads this rank's stages in place
    model.load_state_dict(state)
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["dcp.load"] = _exact(got, {k: v for k, v in want.state_dict().items()})
    opt = optimizer("adamw", model.parameters())
    dpar.checkpoint.load(model, opt, dirs["ddp"])
    got = dpar.checkpoint.full_state_dict(model)
    mine = _optimizer_state(model, opt)
    theirs = _optimizer_state(want, want_opt)
    found["ddp 2 -> pp 2 optimizer"] = _exact(mine, {n: theirs[n] for n in mine})
    if rank == 0:
        found["ddp 2 -> pp 2"] = _exact(got, want.state_dict())

    # pp 2 x dp 2 (fsdp) -> fsdp 2 (dpar.parallelize), optimizer state too.
    fsdp, fsdp_opt = fsdp_loaded_from(dirs["pp_fsdp"], rank, world_size)
    got = dpar.checkpoint.full_state_dict(fsdp)
    mine = _optimizer_state(fsdp, fsdp_opt)
    found["pp 2 x dp 2 -> fsdp 2 optimizer"] = _exact(mine, four["optimizer"])
    if rank == 0:
        found["pp 2 x dp 2 -> fsdp 2"] = _exact(got, four["trained"])

    # GPT-2: the embedding and the LM head are one parameter, read by the first and the last stage.
    model, step = _born_on_meta(rank, world_size, None, "gpt2")
    torch.manual_seed(SEED)
    dpar.init_weights(model)
    got = dpar.checkpoint.full_state_dict(model)
    if rank == 0:
        found["gpt2 init"] = _exact(got, gpt2_init)
    dpar.checkpoint.load_safetensors(model, dirs["st_gpt2"])  # the tied weight: written once, read by both stages
    _train(model, step, rank, world_size)
    want, _ = _torch_ddp(gpt2_weights, rank, world_size, "gpt2")
    got = dpar.checkpoint.full_state_dict(model)
    dpar.checkpoint.save_safetensors(model, dirs["st_gpt2_out"])
    if rank == 0:
        found["gpt2 vs torch ddp"] = _diff(got, want.state_dict())
        out = load_file(os.path.join(dirs["st_gpt2_out"], "model.safetensors"))
        once = set(out) == set(got) - {"inner.lm_head.weight"}  # the tied head: written once, as HF does
        found["gpt2 safetensors out"] = once and _exact(out, {k: got[k] for k in out})
    dist.barrier()
    return found


def test_a_pipeline_born_on_meta_trains_loads_saves_and_initializes(tmp_path) -> None:
    names = ("pp", "pp_fsdp", "ddp", "dcp", "st_pp", "st_fsdp", "st_plain", "st_gpt2", "st_gpt2_out")
    dirs = {name: str(tmp_path / name) for name in names}
    weights, init = _weights(), _one_device_init()
    assert not _exact(init, weights)  # the init cases compare against something other than the loaded weights
    plain = build("llama", LAYERS)
    plain.load_state_dict(weights)
    dpar.checkpoint.save_safetensors(plain, dirs["st_plain"])  # one process, no process group

    fours = run_ranks(_four, 4, dirs, weights, init, timeout_s=300)
    four = fours[0]
    four["optimizer"] = {n: s for r in fours for n, s in r["optimizer"].items()}
    assert four["vs torch ddp"] <= TOLERANCE, four["vs torch ddp"]
    for case in ("safetensors out", "init", "own init", "safetensors in"):
        assert four[case] is True, f"dp 2 x pp 2: {case}"

    gpt2_weights, gpt2_init = _weights("gpt2"), _one_device_init("gpt2")
    gpt2 = build("gpt2", LAYERS)
    gpt2.load_state_dict(gpt2_weights)
    dpar.checkpoint.save_safetensors(gpt2, dirs["st_gpt2"])
    twos = run_ranks(_two, 2, dirs, weights, init, four, gpt2_weights, gpt2_init, timeout_s=300)
    two = twos[0]
    assert two["vs torch ddp"] <= TOLERANCE, two["vs torch ddp"]
    assert two["gpt2 vs torch ddp"] <= TOLERANCE, two["gpt2 vs torch ddp"]
    cases = ("gpt2 init", "gpt2 safetensors out", "safetensors out", "init", "own init", "safetensors in", "dcp.load",
             "ddp 2 -> pp 2", "pp 2 x dp 2 -> fsdp 2")
    for case in cases:
        assert two[case] is True, f"pp 2: {case}"
    for r in twos:
        assert r["ddp 2 -> pp 2 optimizer"] is True and r["pp 2 x dp 2 -> fsdp 2 optimizer"] is True

    # pp 2 -> one process: a plain model and AdamW, no process group.
    opt = optimizer("adamw", plain.parameters())
    dpar.checkpoint.load(plain, opt, dirs["pp"])
    assert _exact({k: v for k, v in plain.state_dict().items()}, two["trained"])
    optimizer_state = {n: s for r in twos for n, s in r["optimizer"].items()}
    assert _exact(_optimizer_state(plain, opt), optimizer_state)
    print(f"max |diff| vs torch DDP: pp 2 {two['vs torch ddp']:.2e}, gpt2 (tied) pp 2 {two['gpt2 vs torch ddp']:.2e}, "
          f"dp 2 x pp 2 fsdp {four['vs torch ddp']:.2e}")


def test_a_step_before_the_state_is_materialized_is_refused_by_name() -> None:
    """One process, no process group: a parameter left on meta, then a parameter and a non-persistent buffer never
    written since to_empty, are refused by name before any graph runs; once given values, the step is the plain
    model's."""
    import pytest

    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    with torch.device("meta"):
        model = build("llama", LAYERS)
    x, y = _slice(0, 0, 1)
    step = dpar.pipeline(model, token_loss, example_inputs=(x, y), stages=1, micro_batches=2)
    meta = r"parameter inner\.model\.embed_tokens\.weight is still on the meta"
    with pytest.raises(dpar.UnmaterializedStateError, match=meta):
        step(x, y)
    model.to_empty(device="cpu")
    unwritten = r"parameter inner\.model\.embed_tokens\.weight was on the meta device .* not been written"
    with pytest.raises(dpar.UnmaterializedStateError, match=unwritten):
        step(x, y)
    model.load_state_dict(_weights())
    unwritten = r"buffer inner\.model\.rotary_emb\.inv_freq .* not been written"
    with pytest.raises(dpar.UnmaterializedStateError, match=unwritten):
        step(x, y)
    _init_rotary(model)
    plain = build("llama", LAYERS)
    assert step(x, y).item() == pytest.approx(token_loss(plain(x), y).item(), rel=1e-6)


def test_an_fsdp_shard_is_the_shard0_block_of_its_rows() -> None:
    """dp_strategy="fsdp"'s flat shard of a parameter is its Shard(0) rows (torch.chunk's cut, uneven included), then
    zero padding: what the state dict's DTensor shows and what the all-gather puts back in order."""
    from dpar.compiler.pipeline_parallel.sharded import ShardLayout

    shapes = ((5, 3), (4,), (1, 2), (7, 2, 2))
    for dp in (2, 3, 4):
        layout = ShardLayout(shapes, torch.float32, dp)
        for i, shape in enumerate(shapes):
            full = torch.randn(shape)
            shards = [layout.shard(full, i, r) for r in range(dp)]
            assert all(s.numel() == layout.chunks[i] for s in shards)
            assert torch.equal(torch.cat(shards)[: full.numel()], full.reshape(-1))
            blocks = full.chunk(dp)
            for r in range(dp):
                start, length = layout.rows(i, r)
                want = blocks[r] if r < len(blocks) else full[:0]
                assert torch.equal(full.narrow(0, start, length), want)
                assert torch.equal(shards[r][: want.numel()], want.reshape(-1))
                assert not shards[r][want.numel():].any()


def _recomputing_born_on_meta(rank: int, world_size: int, weights: dict) -> float | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model, step = _born_on_meta(rank, world_size, (2, 2), activation_checkpointing="full")
    set_model_state_dict(model, dict(weights) if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    _init_rotary(model)
    _train(model, step, rank, world_size)
    want, _ = _torch_ddp(weights, rank, world_size)
    trained = dpar.checkpoint.full_state_dict(model)
    return _diff(trained, want.state_dict()) if rank == 0 else None


# The recomputing cut of a model on real tensors is trained by default in tests/test_pipeline_checkpointing.py.
@pytest.mark.extended
def test_a_pipeline_born_on_meta_recomputes_as_torch_ddp_trains() -> None:
    """(dp 2, pp 2), fsdp over dp, every block recomputed, the stages traced and cut on meta: after to_empty and
    rank 0's weights broadcast, 5 AdamW steps give torch DDP's parameters."""
    diff = run_ranks(_recomputing_born_on_meta, 4, _weights(), timeout_s=300)[0]
    print(f"born on meta, fsdp x pp, full recomputation: max |difference| from torch DDP {diff:.2e}")
    assert diff < 1e-4
