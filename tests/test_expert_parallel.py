"""Expert parallelism ("ep"): routed experts spread over ranks, tokens exchanged by all-to-all in the graphs.

Each rank is fed its own slice of the batch; after 5 AdamW steps every parameter (the experts' gathered whole)
must be torch DDP's on the same slices. fp32 noise is measured, not assumed: DDP trained again from weights
nudged by 1e-7 moves by a control gap, and the ep run must stay within a few times that gap (the experts see
their rows in another order and the dense own MoE sums its experts in another order); in float64 the own
MoE must agree within 1e-9. The forward graph holds the all-to-alls (a wrong routing that skipped them would
leave some experts untrained and fail the comparison), and the graphs compile once for all steps.
"""

from __future__ import annotations

import pytest

from distributed import run_ranks


def _against_torch_ddp(rank: int, world_size: int, cases: tuple[tuple[str, str, tuple[int, ...] | None], ...]) -> dict | None:
    import torch
    import torch._dynamo

    from dpar.compiler import registry
    from third_party import Run, max_abs_diff, nudge, train

    found, references = {}, {}
    for name, strategy, mesh_shape in cases:
        optimizer = _optimizer(name)
        if name not in references:
            references[name] = (train(rank, world_size, Run(name, "torch_ddp", optimizer=optimizer)),
                                train(rank, world_size, Run(name, "torch_ddp", optimizer=optimizer), prepare=nudge))
        reference, control = references[name]
        torch._dynamo.reset()
        with registry.recording() as graphs:
            state, compiled, held = _train(rank, world_size, name, strategy, mesh_shape, graphs)
        kinds = [c.kind for g in graphs if g.label == "forward graph" for c in g.collectives]
        label = f"{strategy} {mesh_shape or world_size}, {name}"
        found[label] = dict(
            graphs_after_each_step=compiled, all_to_alls=kinds.count("all_to_all"), experts_held=held,
            gap=max_abs_diff(reference, state) if rank == 0 else None,
            control=max_abs_diff(reference, control) if rank == 0 else None,
        )
        if name == "own_moe":
            double = lambda model: model.double()
            torch._dynamo.reset()
            reference = train(rank, world_size, Run(name, "torch_ddp"), prepare=double)
            state = _train(rank, world_size, name, strategy, mesh_shape, [], prepare=double)[0]
            found[label]["float64"] = max_abs_diff(reference, state) if rank == 0 else None
    return found if rank == 0 else None


def _optimizer(name: str) -> str:
    return "sgd" if name.startswith("titan_") else "adamw"


def _train(rank: int, world_size: int, name: str, strategy: str, mesh_shape: tuple[int, ...] | None, graphs: list,
           prepare=None) -> tuple[dict | None, list[int], float]:
    """third_party.train's loop, counting the graphs compiled after each step; with the share of the experts'
    weights this rank holds."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import dpar
    from dpar.core.plan import Strategy
    from dpar.surgery.expert_parallel import experts_modules
    from third_party import ROWS_PER_RANK, STEPS, build, global_batch, rank_slice

    model = build(name)
    if prepare is not None:
        prepare(model)
    whole = {f"{n}.{p}": t.numel() for n, m in experts_modules(model).items() for p, t in m.named_parameters(recurse=False)}
    chosen = Strategy.parse(strategy)
    mesh = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=chosen.mesh_dim_names)
    example = rank_slice(global_batch(0, ROWS_PER_RANK * world_size), rank, world_size) if chosen.tensor_parallel else None
    dpar.parallelize(model, strategy=strategy, mesh=mesh, example_inputs=example)
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters() if n in whole)
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if _optimizer(name) == "sgd" else torch.optim.AdamW(
        model.parameters(), lr=1e-3)
    compiled = []
    for step in range(STEPS):
        optimizer.zero_grad()
        runner(*rank_slice(global_batch(step, ROWS_PER_RANK * world_size), rank, world_size)).backward()
        optimizer.step()
        compiled.append(len(graphs))
    return dpar.checkpoint.full_state_dict(model), compiled, held / sum(whole.values())


CASES = {
    # Under tensor parallel the experts are spread over the tp axis by expert, the tokens staying put.
    2: (("own_moe", "ep", None), ("mixtral", "ep", None), ("mixtral", "tp", None)),
    # Qwen3's routed experts under ep (its fsdp+ep below), the own MoE's under tp (Mixtral's above).
    "2 more": (("qwen3_moe", "ep", None), ("own_moe", "tp", None)),
    # torchtitan's MoE debug models (bf16 grouped matmuls, 5 and 8 MoE layers), trained with SGD: AdamW turns the
    # tiny gradients of barely routed experts into steps of size lr, which a 1e-7 nudge already moves by 4e-3.
    "titan": (("titan_deepseek", "ep", None), ("titan_qwen3_moe", "ep", None), ("titan_deepseek", "tp", None),
              ("titan_qwen3_moe", "tp", None)),
    # On ("dp", "ep") meshes: the experts' blocks replicated (ddp+ep) or sharded (zero2+ep, fsdp+ep) over "dp";
    # on a ("dp", "tp") mesh spread over "tp" and sharded over "dp".
    4: (("own_moe", "ddp+ep", (2, 2)), ("qwen3_moe", "fsdp+ep", (2, 2))),
    # The same paths again: a 1-D ep axis of 4, zero2 between ddp's and fsdp's handling of the experts' blocks, fsdp+ep
    # on the own MoE (Qwen3's above), Qwen3's experts over tp sharded over dp (tp's spread: case 2; fsdp's shards: above).
    "4 more": (("own_moe", "ep", None), ("mixtral", "zero2+ep", (2, 2)), ("own_moe", "fsdp+ep", (2, 2)),
               ("qwen3_moe", "fsdp+tp", (2, 2))),
}


@pytest.mark.parametrize("case", [2, 4, *(pytest.param(c, marks=pytest.mark.extended) for c in ("2 more", "titan", "4 more"))])
def test_ep_trains_as_torch_ddp(case: int | str) -> None:
    from third_party import needs_torchtitan

    for name, _, _ in CASES[case]:
        needs_torchtitan(name)
    ranks = {"2 more": 2, "titan": 2, "4 more": 4}.get(case, case)
    found = run_ranks(_against_torch_ddp, ranks, CASES[case], timeout_s=1200)[0]
    for name, figures in found.items():
        print(f"{name}: {figures}")
    for (name, strategy, mesh_shape), f in zip(CASES[case], found.values()):
        if "ep" in strategy:  # per MoE layer: rows and experts out, rows back
            assert f["all_to_alls"] and f["all_to_alls"] % 3 == 0, (name, f)
        # Each rank holds its share of the experts: spread over ep or tp, and sharded over dp where the rest is.
        assert f["experts_held"] == 1 / (mesh_shape[1] if strategy.startswith("ddp+") else ranks), (name, strategy, f)
        assert f["gap"] <= max(10 * f["control"], 1e-6), (name, f)
        assert f["control"] > 0
        assert len(set(f["graphs_after_each_step"])) == 1, (name, f)  # nothing compiled after the first step
    assert all(f["float64"] < 1e-9 for name, f in found.items() if name.endswith("own_moe"))


# Refused by name before the first step, and the structure on a fake world of four ranks (nothing sent).

def _own_moe(num_experts: int = 4):
    import torch

    from moe_models import OwnMoE

    torch.manual_seed(0)
    return OwnMoE(num_experts=num_experts)


def test_a_model_without_routed_experts_is_refused_under_ep(world_of_four) -> None:
    import torch.nn as nn

    import dpar
    from dpar.core.errors import OptionsError

    with pytest.raises(OptionsError, match=r"Sequential has no experts module: a module with num_experts.*For a dense "
                       r"model choose a strategy without 'ep'"):
        dpar.parallelize(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), strategy="ep")


def _listed_experts():
    """A mixture of experts as transformers 4 wrote them: a router and an nn.ModuleList of expert MLPs the layer
    loops over itself."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(4))

        def forward(self, x):
            chosen = self.gate(x).argmax(-1)
            return sum(expert(x) * (chosen == e).unsqueeze(-1) for e, expert in enumerate(self.experts))

    return nn.Sequential(Block())


def test_experts_in_a_module_list_are_refused_by_name_under_ep(world_of_four) -> None:
    import dpar
    from dpar.core.errors import OptionsError

    with pytest.raises(OptionsError, match=r"has no experts module: .*; 0.experts is an nn.ModuleList of 4 expert modules, "
                       r"which its MoE layer loops over itself.*store them stacked"):
        dpar.parallelize(_listed_experts(), strategy="ep")


def test_experts_the_ep_degree_does_not_divide_are_refused(world_of_four) -> None:
    import dpar
    from dpar.core.errors import OptionsError

    with pytest.raises(OptionsError, match=r"blocks.0.experts has 6 experts, which 4 ranks of the 'ep' axis cannot hold"):
        dpar.parallelize(_own_moe(6), strategy="ep")


@pytest.mark.parametrize("strategy, shape, names, message", [
    ("ddp+ep", (2, 2), ("dp", "tp"), r"needs the mesh's dimensions named \('dp', 'ep'\), got \('dp', 'tp'\)"),
    ("ddp+ep", (2, 2), ("ep", "dp"), r"needs the mesh's dimensions named \('dp', 'ep'\), got \('ep', 'dp'\)"),
    ("ep", (2, 2), ("dp", "ep"), r"strategy 'ep' needs a 1-D mesh over the whole world \(4 ranks\)"),
])
def test_a_mesh_not_named_for_its_axes_is_refused(world_of_four, strategy, shape, names, message) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import dpar
    from dpar.core.errors import OptionsError

    with pytest.raises(OptionsError, match=message):
        dpar.parallelize(_own_moe(), strategy=strategy, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))


def test_each_rank_holds_its_experts_and_the_state_dict_holds_them_whole(world_of_four) -> None:
    """ep 4 on four fake ranks: one expert of four per rank, Shard(0) DTensors of the whole (4, ...) shape in the
    state dict; the forward's all-to-alls carry 4 x T x k rows of the hidden width (fixed-size buffers)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    import dpar
    from third_party import global_batch

    model = _own_moe()
    dpar.parallelize(model, strategy="ep")
    experts = model.blocks[0].experts
    assert experts.w_in.shape == (1, 64, 32) and experts.num_experts == 1
    entry = model.state_dict()["blocks.0.experts.w_in"]
    assert isinstance(entry, DTensor) and entry.shape == (4, 64, 32) and entry.placements == (Shard(0),)
    assert isinstance(model.state_dict()["blocks.0.router.weight"], torch.Tensor)
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    ids, labels, mask = (t[:2] for t in global_batch(0, 8))  # this rank's 2 rows of 8 tokens, top-2
    runner(ids, labels, mask).backward()
    forward = next(g for g in world_of_four if g.label == "forward graph")
    exchanged = [c for c in forward.collectives if c.kind == "all_to_all"]
    assert len(exchanged) == 6
    tokens = [c for c in exchanged if c.dtype == torch.float32]
    assert {c.bytes for c in tokens} == {4 * 16 * 2 * 32 * 4}  # ep x pairs x width x 4 bytes, each way


def test_tp_spreads_the_experts_by_expert_and_reduces_their_output(world_of_four) -> None:
    """tp 4 on four fake ranks: one expert of four per rank (a Shard(0) DTensor of the whole in the state dict),
    every token staying put (no all-to-all): each MoE layer's output is a partial sum all-reduced over tp, as is
    its inputs' gradient in the backward (each rank's rows in turn: see [Note: the data contract under tensor
    parallel])."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    import dpar
    from third_party import global_batch

    model = _own_moe()
    batch = tuple(t[:2] for t in global_batch(0, 8))
    dpar.parallelize(model, strategy="tp", example_inputs=batch)
    experts = model.blocks[0].experts
    assert experts.w_in.shape == (1, 64, 32) and experts.num_experts == 1
    entry = model.state_dict()["blocks.0.experts.w_in"]
    assert isinstance(entry, DTensor) and entry.shape == (4, 64, 32) and entry.placements == (Shard(0),)
    torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(*batch).backward()
    forward, backward = (next(g for g in world_of_four if g.label == label) for label in ("forward graph", "backward graph"))
    assert not [c for g in (forward, backward) for c in g.collectives if c.kind == "all_to_all"]
    # Once per layer for each of the group's 4 ranks' rows (2 rows of 8 tokens): the experts' output, the hidden
    # width in fp32 (nothing else in this model reduces in the forward), and in the backward their routing weights'
    # gradient (top-2).
    reduced = lambda graph, size: sum(c.kind == "all_reduce" and c.bytes == size for c in graph.collectives)
    assert reduced(forward, 2 * 8 * 32 * 4) == 4 * 2
    assert reduced(backward, 2 * 8 * 2 * 4) == 4 * 2


def test_tp_keeps_experts_whole_where_its_degree_does_not_divide_them_and_refuses_another_split(world_of_four) -> None:
    import dpar
    from dpar.core.errors import OptionsError
    from third_party import global_batch

    batch = tuple(t[:2] for t in global_batch(0, 8))
    model = _own_moe(7)
    dpar.parallelize(model, strategy="tp", example_inputs=batch)
    assert model.blocks[0].experts.w_in.shape == (7, 64, 32)  # replicated: every rank computes every expert
    with pytest.raises(OptionsError, match=r"tensor parallel splits the experts of blocks.0.experts as \{'blocks.0.experts.w_in': "
                       r"1, 'blocks.0.experts.b_in': None, 'blocks.0.experts.w_out': None\}; an experts module is split "
                       r"by expert, dim 0 of every weight \(tp_plan=\{'blocks.0.experts.w_in': 0, "):
        dpar.parallelize(_own_moe(), strategy="tp", tp_plan={"blocks.0.experts.w_in": 1})


def test_fsdp_ep_shards_the_experts_over_dp_and_the_rest_over_every_rank(world_of_four) -> None:
    """fsdp+ep on a (2, 2) ("dp", "ep") mesh of fake ranks: a rank holds 2 experts of 4 (ep 2), each sharded over
    "dp" (1 of them in its shard), and 1/4 of every other parameter; the graphs gather and reduce-scatter the experts
    over "dp" and the rest over the world, one bucket per block and axis."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import dpar
    from third_party import global_batch

    model = _own_moe()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dpar.parallelize(model, strategy="fsdp+ep", mesh=mesh)
    w_in = model.blocks[0].experts.w_in
    assert w_in.shape == (2, 64, 32) and w_in.to_local().shape == (1, 64, 32) and w_in.device_mesh == mesh["dp"]
    state = model.state_dict()
    assert state["blocks.0.experts.w_in"].shape == (4, 64, 32)
    assert state["blocks.0.experts.w_in"].placements == (Shard(0), Shard(0))
    assert state["blocks.0.router.weight"].placements == (Shard(0),) and state["blocks.0.router.weight"].device_mesh.size() == 4
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    runner(*(t[:2] for t in global_batch(0, 8))).backward()
    world, dp = dist.group.WORLD.group_name, mesh["dp"].get_group().group_name
    experts_shard = sum(p.numel() for n, p in _own_moe().named_parameters() if ".experts." in n) * 4 // 4
    rest_shard = sum(p.numel() for n, p in _own_moe().named_parameters() if ".experts." not in n) * 4 // 4
    forward = next(g for g in world_of_four if g.label == "forward graph")
    gathered = {group: sum(c.bytes for c in forward.collectives if c.kind == "all_gather" and c.group == group)
                for group in (world, dp)}
    assert gathered == {world: rest_shard, dp: experts_shard}  # fsdp: every shard gathered once in the forward
    backward = next(g for g in world_of_four if g.label == "backward graph")
    scattered = {group: [c for c in backward.collectives if c.kind == "reduce_scatter" and c.group == group]
                 for group in (world, dp)}
    assert len(scattered[dp]) == 2 and len(scattered[world]) == 3  # per block, plus the root bucket over the world


def _reshard(rank: int, world_size: int, directory: str) -> dict | None:
    """ep 4 trains 2 steps and saves (DCP); fsdp+ep (2 x 2, ep 2) and fsdp 4 load it from other weights: their
    parameters equal the saved ones exactly, and one more step of fsdp+ep equals one more step of ep 4. Its
    safetensors export loads back into ep 4 exactly; writes through the experts module reach its experts."""
    import torch
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh

    import dpar
    from third_party import global_batch, max_abs_diff, rank_slice

    def trained(strategy: str, seed: int, steps: range, mesh=None, load: bool = False) -> tuple:
        torch._dynamo.reset()
        model = _own_moe()
        if seed:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.0)
        dpar.parallelize(model, strategy=strategy, mesh=mesh)
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if load:
            dpar.checkpoint.load(model, optimizer, directory)
        loaded = dpar.checkpoint.full_state_dict(model)
        for step in steps:
            optimizer.zero_grad()
            runner(*rank_slice(global_batch(step, 2 * world_size), rank, world_size)).backward()
            optimizer.step()
            if step == 1:
                dpar.checkpoint.save(model, optimizer, directory)
                dpar.checkpoint.save_safetensors(model, directory + "-safetensors")
                saved = dpar.checkpoint.full_state_dict(model)
        return (saved if not load else loaded), dpar.checkpoint.full_state_dict(model)

    saved, continued = trained("ep", 0, range(3))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    loaded, resumed = trained("fsdp+ep", 1, range(2, 3), mesh=mesh, load=True)
    fsdp_loaded, _ = trained("fsdp", 1, range(0), load=True)
    torch._dynamo.reset()
    model = _own_moe()
    dpar.parallelize(model, strategy="ep")
    dpar.checkpoint.load_safetensors(model, directory + "-safetensors")
    from_safetensors = dpar.checkpoint.full_state_dict(model)
    writes = {strategy: _writes_through_the_module(rank, strategy, grid)
              for strategy, grid in (("ep", None), ("fsdp+ep", mesh))}
    if rank:
        return None
    return dict(writes=writes, loaded=max_abs_diff(saved, loaded), fsdp_loaded=max_abs_diff(saved, fsdp_loaded),
                safetensors=max_abs_diff(saved, from_safetensors),
                resumed=max_abs_diff(continued, resumed), moved=max_abs_diff(saved, continued))


def _writes_through_the_module(rank: int, strategy: str, mesh=None) -> dict[str, bool]:
    """Writes a user makes on the experts module after parallelize (ep, or fsdp+ep: the experts' blocks sharded over
    dp), each against the same write on the whole model in one process: the full state dict equal bit for bit (and
    the weight frozen, for requires_grad_)."""
    import torch
    import torch.nn as nn

    import dpar

    experts = lambda m, layer: m.blocks[layer].experts
    writes = {
        "copy_": lambda m: experts(m, 0).w_in.copy_(torch.arange(4 * 64 * 32.0).view(4, 64, 32)),
        "fill_": lambda m: experts(m, 0).b_in.fill_(0.25),
        "mul_": lambda m: experts(m, 1).w_out.mul_(3.0),
        "nn.init.normal_": lambda m: (torch.manual_seed(3), nn.init.normal_(experts(m, 1).w_out, std=0.5)),
        "requires_grad_": lambda m: experts(m, 0).w_in.requires_grad_(False),
    }
    found = {}
    for name, write in writes.items():
        whole, model = _own_moe(), _own_moe()
        dpar.parallelize(model, strategy=strategy, mesh=mesh)
        with torch.no_grad():
            write(whole)
            write(model)
        state, expected = dpar.checkpoint.full_state_dict(model), whole.state_dict()
        same = rank != 0 or all(torch.equal(state[k], expected[k]) for k in expected)
        found[name] = same and experts(model, 0).w_in.requires_grad == experts(whole, 0).w_in.requires_grad
    return found


def test_a_checkpoint_reshards_between_ep_degrees_and_to_fsdp_and_safetensors_round_trip(tmp_path) -> None:
    found = run_ranks(_reshard, 4, str(tmp_path / "ckpt"), timeout_s=600)[0]
    print(f"ep 4 -> fsdp+ep (ep 2), fsdp: {found}")
    every_write = dict.fromkeys(("copy_", "fill_", "mul_", "nn.init.normal_", "requires_grad_"), True)
    assert found.pop("writes") == {"ep": every_write, "fsdp+ep": every_write}
    assert found["loaded"] == 0.0 and found["fsdp_loaded"] == 0.0 and found["safetensors"] == 0.0
    assert found["resumed"] < 1e-6 < found["moved"]


def test_inspection_shows_each_ranks_experts_and_prices_the_all_to_alls() -> None:
    """dpar.explain at 8 simulated ranks, own MoE with 8 experts: under ep a rank holds the parameters outside the
    experts and 1 expert of 8 (ddp: all of them; fsdp+ep on (4, 2): a quarter of 4 experts and 1/8 of the rest); the forward's all-to-alls carry 8 x T x k rows of the width and
    are priced by the α-β model."""
    import dpar
    from third_party import global_batch

    batch = tuple(t[:2] for t in global_batch(0, 16))  # this rank's 2 rows of 8 tokens
    reports = {strategy: dpar.explain(_own_moe(8), batch, strategy=strategy, world_size=8)
               for strategy in ("ddp", "ep", "fsdp+ep")}
    model = _own_moe(8)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * 4
    rest = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n) * 4
    assert reports["ddp"].memory.parameters == experts + rest
    assert reports["ep"].memory.parameters == experts // 8 + rest
    assert reports["fsdp+ep"].memory.parameters == experts // 2 // 4 + rest // 8  # (4, 2) mesh: ep 2, dp 4
    exchanged = [c for c in reports["ep"].collectives if c.kind == "all_to_all" and c.dtype == "float32"]
    assert len(exchanged) == 2 * 2 + 2 * 2  # tokens out and back per layer, forward and backward
    assert {c.bytes for c in exchanged} == {8 * 16 * 2 * 32 * 4}
    assert all(c.seconds > 0 for c in exchanged)


# The planner: an ep axis priced as the runtime runs it, and chosen where it wins.

def _tiny_mixtral_on_meta():
    import torch
    import transformers as tf

    config = tf.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    with torch.device("meta"):
        return tf.MixtralForCausalLM(config), (torch.zeros(8, 32, dtype=torch.long, device="meta"),)


def test_the_planner_prices_each_experts_exchange_and_its_share_of_the_experts() -> None:
    """HF Mixtral (2 layers, 8 experts, top-2) at a global batch of 8 x 32 tokens on a (2, 2) ("dp", "ep") mesh: each
    experts module's all-to-alls carry the fixed-size buffers the runtime sends (ep x its 512 / 4 rows x 64 x 4
    bytes), 3 forward and 2 backward; an expert weight takes 16 bytes an element over ep (ddp+ep), over ep and dp
    (zero2+ep), the rest 16 over the 4 ranks under zero2+ep; a dense model is refused ep by name."""
    from dpar.compiler.costs import device_spec
    from dpar.planner.capture import build_op_graph
    import torch

    from dpar.planner.strategies import evaluate_strategies

    model, inputs = _tiny_mixtral_on_meta()
    graph = build_op_graph(model, inputs)
    assert [(e.module, e.num_experts, e.rows, e.width) for e in graph.experts] == [
        (f"model.layers.{i}.mlp.experts", 8, 8 * 32 * 2, 64) for i in range(2)]
    plans = evaluate_strategies(graph, (2, 2), device_spec("h100"))
    assert "takes a 1-D mesh" in plans["ep"]
    buffer = 2 * (8 * 32 * 2 // 4) * 64 * 4
    for name in ("ddp+ep", "zero2+ep", "fsdp+ep"):
        exchange = [c for c in plans[name].collectives if c.mesh_dim == "ep"]
        assert plans[name].count("all_to_all", "ep") == 2 * 5
        assert sorted({(c.phase, c.bytes // c.count) for c in exchange}) == [
            ("backward", buffer), ("forward", buffer // (64 * 4) * 8), ("forward", buffer)]
        assert plans[name].cost.ep_comm_s > 0
    memory = {name: {p.name: p.memory_bytes for p in plans[name].parameters} for name in ("ddp+ep", "zero2+ep")}
    numel = {n: p.numel() for n, p in model.named_parameters()}
    expert, rest = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight"
    assert memory["ddp+ep"][expert] == 16 * numel[expert] // 2 and memory["ddp+ep"][rest] == 16 * numel[rest]
    assert memory["zero2+ep"][expert] == 16 * numel[expert] // 4 and memory["zero2+ep"][rest] == 16 * numel[rest] // 4
    dense = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    refused = evaluate_strategies(build_op_graph(dense, (torch.zeros(4, 8),)), (2, 2), device_spec("h100"))
    assert "has no routed experts" in refused["ddp+ep"]


def test_the_planner_prices_the_experts_spread_over_tp_and_its_plan_spreads_them(world_of_four) -> None:
    """HF Mixtral as above on a (2, 2) ("dp", "tp") mesh: each experts module's weights take 1/tp (placed S(0) over
    tp), and its output (8 x 32 tokens of 64, over dp 2) is all-reduced over tp forward, its inputs' gradient
    backward; the own MoE's plan under ddp+tp, applied, spreads the experts as parallelize's own tp plan does."""
    import torch

    import dpar
    from dpar.compiler.costs import device_spec
    from dpar.planner.capture import build_op_graph
    from dpar.planner.strategies import evaluate_strategies
    from third_party import global_batch

    model, inputs = _tiny_mixtral_on_meta()
    graph = build_op_graph(model, inputs)
    assert [e.output_numel for e in graph.experts] == [8 * 32 * 64] * 2
    plan = evaluate_strategies(graph, (2, 2), device_spec("h100"))["ddp+tp"]
    reductions = [c for c in plan.collectives if "experts" in c.where]
    assert sorted((c.kind, c.mesh_dim, c.phase, c.bytes) for c in reductions) == sorted(
        ("all_reduce", "tp", phase, 8 * 32 * 64 * 4 // 2) for phase in ("forward", "backward") for _ in range(2))
    numel = {n: p.numel() for n, p in model.named_parameters()}
    expert = next(p for p in plan.parameters if p.name == "model.layers.0.mlp.experts.gate_up_proj")
    assert expert.placements == ("R", "S(0)") and expert.memory_bytes == 16 * numel[expert.name] // 2
    assert plan.tp_dims()[expert.name] == 0

    own = evaluate_strategies(build_op_graph(_own_moe(), global_batch(0, 8)), (2, 2), device_spec("cpu"))["ddp+tp"]
    placed = _own_moe()
    dpar.parallelize(placed, plan=own)
    assert placed.blocks[0].experts.w_in.shape == (2, 64, 32) and placed.blocks[0].experts.num_experts == 2
    torch.compile(placed, backend="dpar", options={"compiler": "aot_eager"})(*(t[:2] for t in global_batch(0, 8))).backward()


def test_a_deepseek_v3_shaped_moe_on_64_ranks_plans_expert_parallel() -> None:
    """DeepSeek-V3's shape at 16B (HF DeepseekV3 config: 27 layers, 64 routed experts of 1408, top-6, 2 shared), built
    on meta, 64 x 4096 tokens on an (8, 8) mesh of 80 GB H100s: the planner chooses an ep axis (the experts over the
    node-local dimension), faster than the best plan without one, which it shows beside it."""
    import time

    import torch
    import transformers as tf

    from dpar.compiler.costs import device_spec
    from dpar.planner.capture import build_op_graph
    from dpar.planner.layout import layouts
    from dpar.planning import _fastest

    config = tf.DeepseekV3Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_group=1, topk_group=1)
    with torch.device("meta"):
        model = tf.DeepseekV3ForCausalLM(config)
    started = time.perf_counter()
    graph = build_op_graph(model, (torch.zeros(64, 4096, dtype=torch.long, device="meta"),))
    device = device_spec("h100")
    found = [layout for layout in layouts((8, 8), None, (64,)) if 64 % layout.dp_degree == 0]
    best = _fastest(graph, found, device, device.memory_bytes)
    without = _fastest(graph, [layout for layout in found if layout.ep_axis is None], device, device.memory_bytes)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.1f}B parameters, planned in "
          f"{time.perf_counter() - started:.0f} s: {best.strategy} {best.cost.step_s:.3f} s/step, "
          f"{best.cost.memory_bytes_per_rank / 1e9:.1f} GB; without ep: {without.strategy} {without.cost.step_s:.3f} s, "
          f"{without.cost.memory_bytes_per_rank / 1e9:.1f} GB")
    assert best.strategy.endswith("ep") and best.mesh_dim_names == ("dp", "ep")
    assert best.cost.step_s < without.cost.step_s and best.cost.memory_bytes_per_rank <= device.memory_bytes


def test_a_plan_with_an_ep_axis_is_applied_on_its_mesh(world_of_four) -> None:
    """dpar.plan on the own MoE with mesh_dim_names ("dp", "ep"), then parallelize(plan=...): the runtime gets the
    plan's strategy on a ("dp", "ep") mesh, each rank holding 2 of the 4 experts (sharded over dp under a sharded
    mode, whole under ddp+ep)."""
    import torch

    import dpar
    from third_party import global_batch

    plan = dpar.plan(_own_moe(), global_batch(0, 8), mesh_shape=(2, 2), mesh_dim_names=("dp", "ep"), device="cpu")
    assert plan.strategy in ("ddp+ep", "zero2+ep", "fsdp+ep") and plan.mesh_dim_names == ("dp", "ep")
    model = _own_moe()
    dpar.parallelize(model, plan=plan)
    placed = dpar.placement.plan_of(model)
    assert placed.strategy.value == plan.strategy and [a.name for a in placed.axes] == ["dp", "ep"]
    w_in = model.blocks[0].experts.w_in
    assert w_in.shape == (2, 64, 32)
    assert model.state_dict()["blocks.0.experts.w_in"].shape == (4, 64, 32)
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    runner(*(t[:2] for t in global_batch(0, 8))).backward()


def test_the_experts_grouped_matmuls_are_priced_on_their_routed_rows(world_of_four) -> None:
    """HF Mixtral under ep 4 on fake ranks: its grouped matmuls run on the exchange's fixed-size buffers (4 x the rows
    routed to a rank on average); the forward's and the backward's are marked so, and the cost model counts a
    quarter of the FLOPs their shapes say."""
    import torch
    import transformers as tf

    import dpar
    from dpar.compiler.costs import ROUTED_SHARE, node_flops

    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    model = tf.MixtralForCausalLM(config)
    dpar.parallelize(model, strategy="ep")
    runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    ids = torch.randint(0, 256, (2, 16))
    runner(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    marked = {}
    for g in world_of_four:
        if g.label in ("forward graph", "backward graph (sync)"):
            nodes = [n for n in g.graph.graph.nodes if "grouped_mm" in str(n.target)]
            marked[g.label.split(" (")[0]] = [n.meta.get(ROUTED_SHARE) for n in nodes]
            for n in nodes:
                rows = n.args[0].meta["val"].shape[0]
                assert rows == 4 * 2 * 16 * 2  # ep x this rank's 32 tokens x top-2
                whole = 2 * rows * n.args[0].meta["val"].shape[-1] * n.meta["val"].shape[-1] if "backward" not in str(n.target) else None
                if whole is not None:
                    assert node_flops(n) == whole // 4
    assert marked == {"forward graph": [4, 4], "backward graph": [4, 4]}
