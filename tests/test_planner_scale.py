"""The planner on a 24-block GPT at 64 ranks: repeated blocks collapse, and it plans in seconds."""

from __future__ import annotations

import math
import time

import pytest
import torch
from machine_speed import budget_s
from planner_models import gpt

from dpar.planner.capture import build_op_graph
from dpar.core.plan import Recompute
from dpar.planner.plan import Plan, policy_label
from dpar.planning import plan

GPT_24 = dict(n_layer=24, n_embd=1024, n_head=16, block=1024, vocab=50304, batch=64)


def test_ilp_size_does_not_grow_with_depth():
    sizes = [len(build_op_graph(*gpt(n_layer=n)).ops) for n in (4, 8, 24)]
    assert sizes[0] == sizes[1] == sizes[2]
    graph = build_op_graph(*gpt(n_layer=24))
    assert graph.traced_ops > 10 * len(graph.ops) / 3
    assert {op.count for op in graph.ops if op.module.startswith("blocks.")} == {12}


def _hugging_face(name: str, layers: int, **settings: object):
    """A tests' Hugging Face model (tests/third_party.py) with ``layers`` blocks, and a batch of 4 rows."""
    import third_party

    config = third_party._config(name)
    for key in ("num_hidden_layers", "n_layer"):
        if key in config.to_dict():
            setattr(config, key, layers)
    for key, value in settings.items():
        setattr(config, key, value)
    model = third_party.HuggingFaceLM.__new__(third_party.HuggingFaceLM)
    torch.nn.Module.__init__(model)
    model.name, model.inner = name, type(third_party._hf(name))(config)
    return model, third_party.global_batch(0, 4, 8)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt"])
def test_a_capture_of_the_first_blocks_gives_the_whole_captures_ops(name):
    """[Note: a capture of the first blocks]: 9 blocks captured as 4 and made whole give the ops the whole capture
    gives, every field of every op (names, modules, parameters, what each reads, kernels) equal; GPT-2 and the GPT
    tie their head to the embedding outside the blocks."""
    from dpar.planner import capture

    model, inputs = gpt(n_layer=9, n_embd=64, n_head=4, block=16, vocab=128, batch=4) if name == "gpt" \
        else _hugging_face(name, 9)
    cut = capture._ops_from_first_blocks(model, inputs, batch_size=4)
    whole = capture._ops(model, model, inputs, batch_size=4)
    assert cut is not None and len(cut) == len(whole) > 9 * 10
    assert [i for i, (a, b) in enumerate(zip(whole, cut)) if a != b] == []


def test_the_pipeline_search_prices_each_block_from_the_first_blocks_as_from_the_whole_capture(monkeypatch):
    """The pipeline search's prices, each block a stage of its own under each policy: from a capture of the first
    blocks (the middle ones priced as the last kept middle block of their parity, the last as the kept last) equal
    to the whole capture's, every field (names, flops, seconds, bytes)."""
    from dpar.compiler.costs import device_spec
    from dpar.compiler.pipeline_parallel.costs import with_loss
    from dpar.planner import pipeline

    model, (ids, _) = gpt(n_layer=9, n_embd=64, n_head=4, block=16, vocab=128, batch=4)
    inputs, loss = with_loss((ids,), None)
    first_blocks, found = pipeline._priced_from_first_blocks, []
    monkeypatch.setattr(pipeline, "_priced_from_first_blocks", lambda *args: found.append(first_blocks(*args)) or found[-1])
    cut = pipeline._price_blocks(model, inputs, loss, 1, device_spec("h100"), None)
    assert found[0] is not None  # the first blocks' capture priced it
    monkeypatch.setattr(pipeline, "_priced_from_first_blocks", lambda *args: None)
    whole = pipeline._price_blocks(model, inputs, loss, 1, device_spec("h100"), None)
    assert len(whole.per_block[Recompute.KEEP]) == 9 and set(whole.per_block) == set(Recompute)
    assert cut == whole


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt"])
def test_the_pipeline_search_splits_for_tp_from_the_first_blocks_as_from_the_whole_forward(name, monkeypatch):
    """Each parameter's tensor-parallel split and each column Linear's units (attention heads), read off a forward
    of the first blocks and repeated by parity, equal the whole forward's, in its order too (the error naming the
    units lists them so)."""
    from dpar.planner import pipeline
    from dpar.surgery.blocks import block_list

    model, inputs = gpt(n_layer=9, n_embd=64, n_head=4, block=16, vocab=128, batch=4) if name == "gpt" \
        else _hugging_face(name, 9)
    ids = tuple(x[:1] for x in inputs)
    whole_forward, blocks_run = pipeline.megatron_plan, []
    monkeypatch.setattr(pipeline, "megatron_plan",
                        lambda m, x: blocks_run.append(len(block_list(m)[1])) or whole_forward(m, x))
    cut = pipeline._megatron_from_first_blocks(model, ids)
    assert blocks_run == [4]  # the first blocks' forward answered
    whole = whole_forward(model, ids)
    assert len(whole.dims) > 9 * 4 and any(v is not None for v in whole.dims.values())
    assert bool(whole.units) == (name != "gpt2")  # GPT-2's fused q/k/v splits no head count out
    assert list(cut.dims.items()) == list(whole.dims.items())
    assert list(cut.units.items()) == list(whole.units.items())


def test_a_loss_that_reads_every_block_is_captured_whole():
    """Qwen3-MoE's load-balancing loss reads every block's router logits: what the first blocks' capture cannot
    show for the others, so the model is captured whole."""
    from dpar.planner import capture

    model, inputs = _hugging_face("qwen3_moe", 8)
    assert capture._ops_from_first_blocks(model, inputs, batch_size=4) is None


@pytest.mark.parametrize("mesh_shape", [(8, 8), pytest.param((64,), marks=pytest.mark.extended)])  # a 1-D mesh: `-m extended`
def test_24_block_gpt_plans_at_64_ranks_in_under_15_s(mesh_shape):
    """Under 10 s in every CI run before 2026-11-30; 11.3-12.1 s that day, whose host ran allocation slow, at this
    code and at the last code CI had passed alike (tests/machine_speed.py)."""
    model, inputs = gpt(**GPT_24)  # meta device: no weights allocated
    start = time.perf_counter()
    p = plan(model, inputs, mesh_shape=mesh_shape)
    seconds = time.perf_counter() - start
    print(f"24-block GPT, mesh {mesh_shape}: planned in {seconds:.2f} s (capture included): {p.strategy}, "
          f"{p.cost.step_s * 1e3:.2f} ms/step")
    assert seconds < budget_s(15.0)
    assert len(p.parameters) == len(list(model.parameters()))


def _llama3(size: str, **overrides: int):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from llama3_on_paper import llama3

    from dpar.planning import global_batch

    model, rank_slice = llama3(size, **overrides)  # meta device, one row of 2048 tokens per rank
    return model, rank_slice, global_batch


def _planned_on_h100s(model, global_batch, mesh_shape, **kwargs) -> tuple[Plan, float]:
    """The plan on H100s of 80 GB, and the seconds planning took."""
    start = time.perf_counter()
    p = plan(model, global_batch, mesh_shape=mesh_shape, memory_budget_gb=80, device="h100", **kwargs)
    return p, time.perf_counter() - start


@pytest.mark.parametrize(("size", "mesh_shape", "seq", "recomputes"),
                         [("8b", (8, 8), 2048, False), ("70b", (32, 8), 4096, True)])
def test_llama3_plans_within_80_gb_in_under_60_s(size, mesh_shape, seq, recomputes):
    """Llama 3 on 64 / 256 H100s, 80 GB each, one row a rank: 8B keeps its activations; 70B's would take 282 GB per
    rank on its layout (fp32 activations of 4,096 tokens), so the plan recomputes instead of failing, the fastest policy
    that fits and, of policies as fast, the one that recomputes least. 70B runs tensor parallel inside the node
    (the last dimension, NVLink) with sequence parallel and sharded data parallel across, faster by the model's
    own prices than FSDP x TP, which the plan shows beside it, than fsdp over all 256 ranks (whose gathers of
    70B parameters across nodes outlast the compute), and than the pipeline search's best, searched in the same call."""
    model, rank_slice, global_batch = _llama3(size, seq=seq)
    p, seconds = _planned_on_h100s(model, global_batch(rank_slice, math.prod(mesh_shape)), mesh_shape)
    print(f"Llama-3-{size} on {mesh_shape}: {p.strategy}, {policy_label(p.activations)}, "
          f"{p.cost.step_s * 1e3:.1f} ms/step, {p.cost.memory_bytes_keep / 1e9:.2f} -> "
          f"{p.cost.memory_bytes_per_rank / 1e9:.2f} GB per rank, planned in {seconds:.1f} s")
    assert seconds < budget_s(60.0) and "the pipeline search" in dict(p.seconds)  # one answer over placements and pipelines
    assert p.cost.memory_bytes_per_rank <= 80e9 and p.pipeline is None
    assert p.activations.recomputes is recomputes
    assert {o.policy: o.fits for o in p.policies}["keep"] is not recomputes
    if recomputes:
        fits = [o for o in p.policies if o.fits]
        assert p.cost.step_s == min(o.step_s for o in fits)
        assert p.cost.recompute_s == min(o.recompute_s for o in fits if o.step_s == p.cost.step_s)
        assert p.cost.recompute_s < {o.policy: o.recompute_s for o in p.policies}["full"]
        named = {o.strategy: o for o in p.strategies}
        assert p.mesh_dim_names == ("dp", "tp") and p.data_parallel in ("zero2", "fsdp") and p.sequence_parallel
        assert named["fsdp+tp (sequence parallel)"].fits and p.cost.step_s <= named["fsdp+tp (sequence parallel)"].step_s
        assert p.cost.step_s < named["fsdp"].step_s / 2
        # The pipeline search's best on the same 256 ranks (pp 8 x tp 8 x dp 4, 10.5 s) is slower: the answer is the placement plan.
        pipelined = [o for o in p.strategies if o.strategy.startswith("pipeline ")]
        assert len(pipelined) == 1 and pipelined[0].fits and pipelined[0].step_s > p.cost.step_s and p.pipeline is None


def test_llama3_8b_at_131k_tokens_on_64_ranks_splits_its_sequences():
    """Llama-3-8B, 8 sequences of 131,072 tokens on 64 H100s of 80 GB (8 x 8): no data-parallel layout fits (8
    sequences for 64 ranks), tensor parallel only with sequence parallel and every block recomputed, slower than
    splitting every sequence over 8 ranks: the plan feeds each cp group one sequence and gathers keys and values at
    every attention, forward and backward (the all-to-all to heads would move less at cp 8, but Hugging Face's
    attention reads a causal mask with a row per query, which by heads every rank would hold whole)."""
    model, batch, _ = _llama3("8b", rows=8, seq=131072)  # the global batch: 8 rows for 64 ranks
    p, seconds = _planned_on_h100s(model, batch, (8, 8))
    print(f"Llama-3-8B at 131k tokens on 8 x 8: {p.strategy} {p.mesh_dim_names}, {policy_label(p.activations)}, "
          f"{p.cost.step_s:.2f} s/step (cp exchange {p.cost.cp_comm_s * 1e3:.0f} ms), "
          f"{p.cost.memory_bytes_per_rank / 1e9:.2f} GB per rank, planned in {seconds:.1f} s")
    assert seconds < budget_s(60.0)
    assert p.mesh_dim_names == ("dp", "cp") and p.strategy.endswith("+cp") and p.same_batch_in_cp_group
    assert p.cost.memory_bytes_per_rank <= 80e9 and p.cost.cp_comm_s > 0
    assert p.attention_exchange == "all_gather"
    assert p.count("all_gather", "cp", "forward") == p.count("all_gather", "cp", "backward") == 2 * 32  # K, V a layer
    assert p.count("reduce_scatter", "cp", "backward") == 2 * 32
    named = {o.strategy: o for o in p.strategies}  # priced alike, side by side
    assert not any(o.fits for name, o in named.items() if "+" not in name or name.endswith("+tp"))
    fastest_tp = min(o.step_s for name, o in named.items() if "tp" in name and o.fits)
    assert named["fsdp+tp (sequence parallel)"].fits and p.cost.step_s < fastest_tp


def test_a_long_sequence_without_a_mask_is_exchanged_to_heads():
    """The tests' GPT (causal by the kernel's flag, no mask) at Llama-3-8B's width, 32 heads, 8 sequences of 32,768
    tokens on 8 x 8 H100s as ("dp", "cp"): the plan exchanges every attention's queries, keys and values to heads and
    its output back (4 all-to-alls a layer each way), faster than gathering keys and values, and says so."""
    model, batch = gpt(n_layer=2, n_embd=4096, n_head=32, block=32768, vocab=32000, batch=8)
    p, seconds = _planned_on_h100s(model, batch, (8, 8), mesh_dim_names=("dp", "cp"))
    print(f"GPT 4096 wide at 32k tokens on 8 x 8 (dp, cp): {p.strategy}, {p.attention_exchange}, cp exchange "
          f"{p.cost.cp_comm_s * 1e3:.1f} ms, {p.cost.step_s:.3f} s/step, planned in {seconds:.1f} s")
    assert p.attention_exchange == "all_to_all" and "exchanged to heads (all-to-all)" in str(p)
    assert p.count("all_to_all", "cp", "forward") == p.count("all_to_all", "cp", "backward") == 4 * 2
    assert not p.count("all_gather", "cp") and not p.count("reduce_scatter", "cp")


def test_a_tensor_parallel_plan_splits_no_norm_weight():
    """The runtime reads a per-feature scale whole (its propagation has no rule keeping a norm's weight split):
    the search once split Llama-3-8B's final norm along the hidden size on 8 x 8 (dp x tp), a plan
    parallelize(plan=...) refused by name. Two of its layers give the same choice in seconds."""
    model, rank_slice, global_batch = _llama3("8b", num_hidden_layers=2)
    p = plan(model, global_batch(rank_slice, 64), mesh_shape=(8, 8), mesh_dim_names=("dp", "tp"), device="h100")
    assert "tp" in p.strategy
    assert [d for n, d in p.tp_dims().items() if "norm" in n] == [None] * 5
    assert any(d is not None for d in p.tp_dims().values())


def test_at_16k_ranks_the_plan_is_no_slower_than_any_named_strategy():
    """The ILP's tie-breakers are priced in units of the ideal step (the single device's compute over the world):
    in units of the single device's compute a step at 16,384 ranks is ~1e-4 of one, and the layout tie-breaker
    (1e-4 a position) chose fsdp at 128 s a step over fsdp+tp at 19.6 s for Llama-3-405B, and for Llama-3-8B on
    2048 x 8, here, a plan at 0.982 s beside the named zero2+tp's 0.974 s."""
    model, rank_slice, global_batch = _llama3("8b")
    p, seconds = _planned_on_h100s(model, global_batch(rank_slice, 16384), (2048, 8), pipelines=False)
    fitting = {o.strategy: o.step_s for o in p.strategies if o.fits}
    print(f"Llama-3-8B on (2048, 8): {p.strategy}, {p.cost.step_s:.3f} s/step; named: {fitting}, planned in {seconds:.1f} s")
    assert p.cost.step_s <= min(fitting.values()) * (1 + 1e-9)
