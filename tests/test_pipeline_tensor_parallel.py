"""dpar.pipeline over a mesh with a "tp" dimension: each stage's layers split Megatron-style over tp.

Each rank is fed its own slice (DDP's contract); after 5 AdamW steps the parameters must equal one process on the
global batch and torch DDP on the same slices (tolerances from NOTES.md), on every schedule. Bad meshes and plans
are refused by name before anything runs.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch

import dpar
import third_party
from distributed import run_ranks
from pipeline_training import ROWS_PER_RANK, batch, build, one_process, pipelined, token_loss, torch_ddp
from training import max_abs_diff

TOLERANCE = 1e-4  # AdamW, NOTES.md


def _stages(schedule: str, pp: int) -> int:
    return 2 * pp if schedule in ("interleaved_1f1b", "zbv") else pp


Case = tuple[str, ...]  # (dp_strategy, schedule), or with the stage compiler third (default aot_eager)


def _cases_and_torch_ddp(rank: int, world_size: int, name: str, layers: int, mesh_shape: tuple[int, ...],
                         mesh_names: tuple[str, ...], cases: tuple[Case, ...], options: dict) -> dict:
    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    warnings.simplefilter("ignore", UserWarning)  # DTensor's note on gathering a ("tp", "dp") shard in two steps
    pp = mesh_shape[mesh_names.index("pp")]
    results = {}
    for dp_strategy, schedule, *compiler in cases:
        state, losses, _, _ = pipelined(rank, world_size, name, layers, "adamw", schedule, _stages(schedule, pp), 4,
                                        mesh_shape=mesh_shape, mesh_names=mesh_names, dp_strategy=dp_strategy,
                                        compiler=compiler[0] if compiler else "aot_eager", **options)
        results[(dp_strategy, schedule, *compiler)] = (state, losses)
    results["torch_ddp"] = torch_ddp(rank, world_size, name, layers, "adamw")
    return results


def _assert_matches_one_process_and_torch_ddp(name: str, layers: int, mesh_shape: tuple[int, ...],
                                              mesh_names: tuple[str, ...], cases: tuple[Case, ...],
                                              timeout_s: float, **options) -> None:
    world_size = int(torch.tensor(mesh_shape).prod())
    reference, reference_losses = one_process(name, layers, "adamw", world_size)
    results = run_ranks(_cases_and_torch_ddp, world_size, name, layers, mesh_shape, mesh_names, cases,
                        options, timeout_s=timeout_s)
    ddp = results[0]["torch_ddp"]
    for case in cases:
        state = results[0][case][0]
        assert max_abs_diff(reference, state) < TOLERANCE, case
        assert max_abs_diff(ddp, state) < TOLERANCE, case
        for result in results:  # every rank returns the same mean loss, the global batch's
            assert result[case][1] == pytest.approx(reference_losses, rel=1e-5), case


# Interleaved 1F1B by default (virtual stages, each holding tp's collectives); 1F1B and ZBV train beside tp by default
# below (GPT-2's tied sequence parallel under 1F1B, the 8-rank dp x pp x tp under ZBV); here they, GPipe and ZB-H1
# run by `-m extended`.
@pytest.mark.parametrize("schedules", [("interleaved_1f1b",),
                                       pytest.param(("1f1b", "zbv", "gpipe", "zb_h1"), marks=pytest.mark.extended)],
                         ids=["default", "extended"])
def test_pp_by_tp_matches_one_process_and_torch_ddp_on_every_schedule(schedules: tuple[str, ...]):
    """(pp 2, tp 2) on 4 ranks, HF Llama (GQA: 4 query heads, 2 key/value heads, split 2 and 1 per rank)."""
    _assert_matches_one_process_and_torch_ddp("llama", 4, (2, 2), ("pp", "tp"), tuple(("ddp", s) for s in schedules),
                                              timeout_s=600)


# Compiled by Inductor (every stage graph lowered, the tp collectives with them, [Note: compiled pipeline stages];
# the optimizer's step compiled too): `-m extended`, 97 s on 2 cores; compiled stages run by default in
# test_pipeline_compiled, tp collectives under Inductor in test_inductor's fsdp+tp.
@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.extended)])
def test_tied_embedding_and_sequence_parallel_over_pp_by_tp(compiler: str):
    """GPT-2's tied embedding and head on the first and last stage, split by vocabulary rows over tp and summed
    over pp (1F1B: the two stages on two ranks); sequence parallel between the split layers."""
    _assert_matches_one_process_and_torch_ddp("gpt2", 4, (2, 2), ("pp", "tp"), (("ddp", "1f1b", compiler),),
                                              timeout_s=900, sequence_parallel=True)


# tests/test_pipeline_checkpointing.py checks tp stages' recomputing cut in a fake world by default.
@pytest.mark.extended
def test_recomputing_tensor_parallel_stages_with_sequence_parallel_match_one_process():
    """HF Llama over (pp 2, tp 2) under zbv, every block recomputed, sequence parallel between the split layers:
    the tp collectives are saved (never run again in the backward), the rest computed again."""
    _assert_matches_one_process_and_torch_ddp("llama", 4, (2, 2), ("pp", "tp"), (("ddp", "zbv"),), timeout_s=600,
                                              activation_checkpointing="full", sequence_parallel=True)


def test_dp_by_pp_by_tp_matches_one_process_and_torch_ddp():
    """(dp 2, pp 2, tp 2) on 8 ranks, HF Llama of 4 layers (one a stage): fsdp over dp under zbv, whose
    reduce-scatter goes where a V's last W is. One launch of the 8 ranks. Every schedule under ddp and fsdp under 1f1b
    passed too (216 s for the 7 cases on 2 cores, when tp inside stages landed); the suite runs this one: each
    schedule's pipeline order is covered over (pp, tp) on 4 ranks above, ddp over dp and fsdp's reduce-scatter in
    the last B over (dp, pp) in test_pipeline_parallel."""
    _assert_matches_one_process_and_torch_ddp("llama", 4, (2, 2, 2), ("dp", "pp", "tp"), (("fsdp", "zbv"),),
                                              timeout_s=900)


def _titan_trained_saved_and_loaded(rank: int, world_size: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline_training import STEPS, optimizer

    warnings.simplefilter("ignore", dpar.PipelineBubbleWarning)
    warnings.simplefilter("ignore", UserWarning)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    own = lambda step: tuple(t.chunk(world_size)[rank] for t in batch(step, ROWS_PER_RANK * world_size))  # noqa: E731

    def pipeline() -> tuple[torch.nn.Module, dpar.PipelineStep]:
        model = build("titan_llama3", 0)
        return model, dpar.pipeline(model, token_loss, example_inputs=own(0), stages=2, micro_batches=4, mesh=mesh)

    model, step = pipeline()
    opt = optimizer("adamw", model.parameters())
    losses = []
    for i in range(STEPS):
        losses.append(step(*own(i)).item())
        opt.step()
        opt.zero_grad()
    found = {"losses": losses, "trained": dpar.checkpoint.full_state_dict(model)}
    dpar.checkpoint.save(model, opt, root)
    resumed, _ = pipeline()
    dpar.checkpoint.load(resumed, optimizer("adamw", resumed.parameters()), root)
    found["dcp resumed"] = dpar.checkpoint.full_state_dict(resumed)
    given, _ = pipeline()  # the whole state dict on every rank, each keeping its stages
    whole = [found["trained"]]
    torch.distributed.broadcast_object_list(whole, src=0)
    given.load_state_dict(whole[0])
    found["load_state_dict"] = dpar.checkpoint.full_state_dict(given)
    if rank == 0:
        plain = build("titan_llama3", 0)
        plain.load_state_dict(found["trained"])
        found["plain model"] = dict(plain.state_dict())
    return found


def test_torchtitan_llama3_over_pp_by_tp_trains_saves_and_loads(tmp_path):
    """torchtitan's own Llama 3 (debug model) over (pp 2, tp 2), 1F1B: trains as one process (and its losses), and its
    state goes out and back in (dpar.checkpoint, load_state_dict of the whole model on every rank, into a plain
    model) under the names torchtitan's state-dict hooks give its fused ``wqkv`` (``wq``, ``wk``, ``wv``: no
    parameter has them; each belongs to the rank holding the module's parameter). torch's
    ``set_model_state_dict(broadcast_from_rank0=True)`` keys what it broadcasts by parameter names and misses
    such entries on ranks other than 0 (a plain model too)."""
    third_party.needs_torchtitan("titan_llama3")
    reference, reference_losses = one_process("titan_llama3", 0, "adamw", 4)
    found = run_ranks(_titan_trained_saved_and_loaded, 4, str(tmp_path), timeout_s=600)
    first = found[0]
    trained = first["trained"]
    assert trained.keys() == reference.keys()
    assert any(k.endswith("qkv_linear.wq.weight") for k in trained)
    assert max_abs_diff(reference, trained) < TOLERANCE
    for result in found:
        assert result["losses"] == pytest.approx(reference_losses, rel=1e-5)
    for way in ("dcp resumed", "load_state_dict", "plain model"):
        assert first[way].keys() == trained.keys(), way
        assert all(torch.equal(first[way][k], trained[k]) for k in trained), way


def _slice() -> tuple[torch.Tensor, torch.Tensor]:
    return batch(0, ROWS_PER_RANK)


def _collectives(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(
        str(n.target).removeprefix("_c10d_functional.").removesuffix(".default") for n in gm.graph.nodes
        if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)
    )


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_each_rank_holds_blocks_and_the_stage_graphs_hold_the_tp_collectives(world_of_four, device):
    """Column Linears hold their rows, row Linears their columns, norms whole; each layer's two row-parallel
    outputs are all-reduced in F, and the split layers' input gradients in the backward (B, or I and W). Built
    on meta, HF's attention gets an explicit causal mask and SDPA's math path a ``_safe_softmax``, which stays
    split by heads (it once ran whole: an all-gather of every layer's attention scores). There micro-batches of one
    row: at two, the math path's view of (batch, heads) as one dimension still gathers q, k and v."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    with torch.device(device):
        model = build("llama", 4)
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    step = dpar.pipeline(model, token_loss, example_inputs=_slice(), stages=2, mesh=mesh, schedule="zb_h1",
                         micro_batches=8 if device == "cpu" else 16)
    held = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layer = "inner.model.layers.0."
    assert held[layer + "self_attn.q_proj.weight"] == (16, 32) and held[layer + "self_attn.k_proj.weight"] == (8, 32)
    assert held[layer + "self_attn.o_proj.weight"] == (32, 16) and held[layer + "mlp.down_proj.weight"] == (32, 32)
    assert held[layer + "input_layernorm.weight"] == whole[layer + "input_layernorm.weight"]
    assert {n: tuple(t.shape) for n, t in model.state_dict().items() if n in held} == {n: whole[n] for n in held}
    (stage,) = step.graphs
    graphs = step.graphs[stage]
    assert _collectives(graphs.forward) == {"all_reduce": 4}  # two layers, attention and MLP outputs
    assert _collectives(graphs.backward)["all_reduce"] == 12
    assert _collectives(graphs.backward_input) + _collectives(graphs.backward_weight) == _collectives(graphs.backward)


@pytest.mark.parametrize(
    "mesh_shape, names, name, kwargs, error, message",
    [
        ((1, 4), ("pp", "tp"), "llama", dict(), dpar.TensorParallelPlanError,
         r"a tp degree of 4 does not divide the units a view cuts the output of "
         r"inner.model.layers.0.self_attn.k_proj.weight into \(2\).*attention heads"),
        ((2, 2), ("pp", "tp"), "gpt", dict(stages=2), dpar.TensorParallelPlanError,
         r"inner.blocks.0.attn.qkv.weight into \(3\).*the q/k/v parts of a fused projection"),
        ((2, 2), ("pp", "tp"), "llama", dict(tp_plan={"inner.model.layers.0.mlp.up_proj.weight": 0, "lm_head.weight": 0}),
         dpar.TensorParallelPlanError, r"tp_plan names 'lm_head.weight', which no stage reads"),
        ((2, 2), ("dp", "tp"), "llama", dict(), dpar.OptionsError,
         r"mesh dimensions \('dp', 'tp'\) are not \('pp',\), \('dp', 'pp'\), \('pp', 'tp'\) or \('dp', 'pp', 'tp'\)"),
        ((2, 2), ("pp", "pp2"), "llama", dict(), dpar.OptionsError, r"mesh dimensions \('pp', 'pp2'\) are not"),
        ((2, 2), ("dp", "pp"), "llama", dict(sequence_parallel=True), dpar.OptionsError,
         r"tp_plan and sequence_parallel split each stage over a mesh's 'tp' dimension, and the mesh has none"),
    ],
    ids=["tp-does-not-divide-kv-heads", "tp-does-not-divide-fused-qkv", "plan-names-no-stage-parameter",
         "no-pp-dimension", "unknown-dimension", "sequence-parallel-without-tp"],
)
def test_bad_tensor_parallel_meshes_and_plans_are_refused_before_anything_runs(world_of_four, mesh_shape, names, name,
                                                                               kwargs, error, message):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    arguments = dict(example_inputs=_slice(), stages=mesh_shape[names.index("pp")] if "pp" in names else 2,
                     micro_batches=4, mesh=mesh) | kwargs
    model = build(name, 4)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(error, match=message):
        dpar.pipeline(model, token_loss, **arguments)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # nothing split, nothing released


def test_fsdp_beside_tp_holds_a_dp_shard_of_each_block():
    """(dp 2, pp 2, tp 2), dp_strategy="fsdp" (8 fake ranks): each parameter at rest is the Shard(0) over dp of
    this rank's tp block, and the state dict shows it whole, as a [Shard(dim), Shard(0)] DTensor over ("tp", "dp")."""
    from fake_world import fake_world
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
        model = build("llama", 4)
        whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
        dpar.pipeline(model, token_loss, example_inputs=_slice(), stages=2, micro_batches=4, mesh=mesh,
                      dp_strategy="fsdp")
        held = dict(model.named_parameters())
        q = "inner.model.layers.0.self_attn.q_proj.weight"
        assert tuple(held[q].shape) == (16, 32) and tuple(held[q].to_local().shape) == (8, 32)
        state = model.state_dict()
        assert tuple(state[q].shape) == whole[q] and list(state[q].placements) == [Shard(0), Shard(0)]
        assert state[q].device_mesh.mesh_dim_names == ("tp", "dp")
        o = "inner.model.layers.0.self_attn.o_proj.weight"
        assert tuple(held[o].to_local().shape) == (16, 16) and list(state[o].placements) == [Shard(1), Shard(0)]

