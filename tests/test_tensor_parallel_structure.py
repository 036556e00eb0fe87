"""Structure of tensor parallel (the propagation pass), in one process with the fake process group."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import dpar
from dpar.compiler.collectives import collectives
from dpar.compiler.megatron import megatron_dims
from fake_world import fake_world
from gpt import GPT, GPTConfig

BATCH, HIDDEN, BLOCKS = 8, 32, 3


class MLPBlocks(nn.Module):
    """A replicated stem, then residual blocks of two Linears (Megatron's MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(HIDDEN, 4 * HIDDEN), "down": nn.Linear(4 * HIDDEN, HIDDEN)})
            for _ in range(BLOCKS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block["down"](F.gelu(block["up"](x)))
        return x.sum()


def compile_under_tp(model: nn.Module, world: int, *inputs: torch.Tensor, **kwargs) -> dict[str, fx.GraphModule]:
    """The graphs of the tensor-parallel pass itself: the group is fed one batch (Megatron's habit),
    so no copy per rank (tests/test_tensor_parallel_data_contract.py covers those)."""
    with fake_world(world) as graphs:
        dpar.parallelize(
            model, strategy="tp", mesh=init_device_mesh("cpu", (world,)), same_batch_in_tp_group=True, **kwargs
        )
        torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(*inputs).backward()
        return {g.label: g.graph for g in graphs}


def test_megatron_pairs_column_then_row_from_the_traced_forward() -> None:
    dims = megatron_dims(MLPBlocks(), (torch.randn(BATCH, 16),))
    # Pairs in dataflow order: the stem (column) feeds up (row), whose partial sum ends the pair.
    assert [dims["stem.weight"], dims["blocks.0.up.weight"], dims["blocks.0.down.weight"]] == [0, 1, 0]
    gpt = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, fused_qkv=False))
    dims = megatron_dims(gpt, (torch.randint(0, 256, (2, 16)),))
    assert [dims[f"blocks.0.attn.{p}.weight"] for p in ("q", "k", "v", "proj")] == [0, 0, 0, 1]
    assert [dims[f"blocks.0.mlp.{p}.weight"] for p in ("up", "down")] == [0, 1]
    assert dims["blocks.0.mlp.up.bias"] == 0 and dims["blocks.0.mlp.down.bias"] is None
    assert dims["tok_emb.weight"] == 0  # tied to the column-parallel LM head: split by vocabulary
    assert dims["pos_emb.weight"] is None and dims["blocks.0.ln_attn.weight"] is None


def test_mlp_block_has_one_all_reduce_forward_and_backward_of_megatron_bytes() -> None:
    world = 4
    plan = {f"blocks.{i}.{name}": dim for i in range(BLOCKS) for name, dim in
            (("up.weight", 0), ("up.bias", 0), ("down.weight", 1), ("down.bias", None))}
    graphs = compile_under_tp(MLPBlocks(), world, torch.randn(BATCH, 16), tp_plan=plan)
    forward, backward = collectives(graphs["forward graph"]), collectives(graphs["backward graph"])
    print([(c.kind, c.shape, c.bytes) for c in forward], [(c.kind, c.shape, c.bytes) for c in backward])
    # Megatron: f is identity forward / all-reduce backward, g the reverse: one of each per block.
    assert [c.kind for c in forward] == ["all_reduce"] * BLOCKS
    assert [c.kind for c in backward] == ["all_reduce"] * BLOCKS
    activation_bytes = BATCH * HIDDEN * 4  # the block's output (forward) / input gradient (backward)
    assert all(c.bytes == activation_bytes for c in forward + backward)
    # Each rank's matmuls see a quarter of the 4h dimension.
    shapes = [n.meta["val"].shape for n in graphs["forward graph"].graph.nodes if n.target is torch.ops.aten.mm.default]
    assert (BATCH, 4 * HIDDEN // world) in shapes


def test_attention_splits_heads_and_gpt_moves_megatron_bytes() -> None:
    config = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32, fused_qkv=False)
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 16))
    graphs = compile_under_tp(GPT(config), 2, idx, idx, example_inputs=(idx,))
    forward = graphs["forward graph"].graph
    attention = [n for n in forward.nodes if "scaled_dot_product" in str(n.target)]
    assert len(attention) == config.n_layer
    assert all(n.args[0].meta["val"].shape == (2, config.n_head // 2, 16, 8) for n in attention)  # heads split
    reduced = lambda label: [(c.kind, c.bytes) for c in collectives(graphs[label]) if c.kind == "all_reduce"]
    activation_bytes, statistics = 2 * 16 * config.n_embd * 4, 2 * 16 * 4  # a row's max or sum of exponentials
    # Forward: the vocabulary-split embedding, then attention and MLP per block; the logits stay split by
    # vocabulary: the log-softmax's row max and sum, and the loss's partial sum (a scalar), are all-reduced.
    assert [nbytes for _, nbytes in reduced("forward graph")] == [activation_bytes] * (1 + 2 * config.n_layer) + [
        statistics, statistics, 4]
    assert "all_gather" not in [c.kind for c in collectives(graphs["forward graph"])]
    # Backward: the log-softmax's row sum of the gradient, each block's two input gradients, and the LM head's.
    assert sorted(nbytes for _, nbytes in reduced("backward graph")) == [statistics] + [activation_bytes] * (
        2 * config.n_layer + 1)
    # The LM head's weight gradient is computed as this rank's vocabulary block, not whole then sliced.
    products = [tuple(n.meta["val"].shape) for n in graphs["backward graph"].graph.nodes if n.target is torch.ops.aten.mm.default]
    assert (256 // 2, config.n_embd) in products and (256, config.n_embd) not in products


def test_sequence_parallel_turns_each_all_reduce_into_reduce_scatter_and_all_gather() -> None:
    """Megatron-SP: the residual stream and its norms hold T/tp tokens; per block and direction,
    each all-reduce of B·T·C becomes a reduce-scatter of it plus an all-gather back, the same bytes."""
    config = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32, fused_qkv=False)
    batch, seq, tp = 2, 16, 2
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (batch, seq))
    graphs = compile_under_tp(GPT(config), tp, idx, idx, example_inputs=(idx,), sequence_parallel=True)
    forward, backward = collectives(graphs["forward graph"]), collectives(graphs["backward graph"])
    print([(c.kind, c.bytes) for c in forward], [(c.kind, c.bytes) for c in backward], sep="\n")
    activation_bytes = batch * seq * config.n_embd * 4
    exchanges = 1 + 2 * config.n_layer  # the embedding's partial sum, then attention and MLP per block
    kinds = lambda cs: [c.kind for c in cs]
    statistics = batch * seq * 4  # the loss's log-softmax: a row's max, its sum of exponentials (the logits stay split)
    assert [c.bytes for c in forward if c.kind == "all_reduce"] == [statistics, statistics, 4]
    assert [c.bytes for c in forward if c.kind == "reduce_scatter"] == [activation_bytes] * exchanges
    # Gathered before each block's two column-parallel layers and the LM head.
    assert [c.bytes for c in forward if c.kind == "all_gather"] == [activation_bytes // tp] * exchanges
    assert [c.bytes for c in backward if c.kind == "reduce_scatter"] == [activation_bytes] * exchanges
    # Gathered gradients for the row-parallel layers' backward; the norms' outputs gathered again
    # (saved as T/tp tokens, not whole) for the column-parallel weight gradients; the position table's gradient.
    assert sorted(c.bytes for c in backward if c.kind == "all_gather") == sorted(
        [activation_bytes // tp] * 2 * exchanges + [seq * config.n_embd * 4 // tp]
    )
    # The norms' weight and bias gradients are partial sums over the token shards: all-reduced.
    norms = 2 * config.n_layer + 1
    assert sorted(c.bytes for c in backward if c.kind == "all_reduce") == [config.n_embd * 4] * (2 * norms) + [statistics]
    # Every layer norm runs on this rank's T/tp tokens.
    norm_inputs = [
        n.args[0].meta["val"].shape for n in graphs["forward graph"].graph.nodes
        if n.target is torch.ops.aten.native_layer_norm.default
    ]
    assert norm_inputs == [(batch, seq // tp, config.n_embd)] * norms


def saved_for_backward(forward: fx.GraphModule) -> list[tuple[int, ...]]:
    """Shapes of the activations a forward graph returns for its backward (not its inputs)."""
    return [
        tuple(n.meta["val"].shape) for n in forward.graph.output_node().args[0][1:]
        if isinstance(n, fx.Node) and n.op != "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    ]


def test_sequence_parallel_saves_the_token_stream_split_along_the_sequence() -> None:
    """Without sequence parallel the norms' inputs and outputs are saved whole; with it, every
    saved (B, T, C) activation holds T/tp tokens and the gathered ones are gathered again."""
    config = GPTConfig(block_size=16, n_layer=2, n_head=4, n_embd=32, fused_qkv=False)
    batch, seq, tp, channels = 2, 16, 2, 32
    idx = torch.randint(0, 256, (batch, seq))
    saved = {}
    for sp in (False, True):
        graphs = compile_under_tp(GPT(config), tp, idx, idx, example_inputs=(idx,), sequence_parallel=sp)
        saved[sp] = saved_for_backward(graphs["forward graph"])
    whole = {(batch, seq, channels), (batch * seq, channels)}
    print(sorted(saved[False]), sorted(saved[True]), sep="\n")
    assert sum(s in whole for s in saved[False]) == sum(s == (batch, seq // tp, channels) for s in saved[True]) > 0
    assert not any(s in whole for s in saved[True])


def test_sequence_parallel_gathers_one_rows_token_stream_again_in_the_backward() -> None:
    """HF Llama, one row: the token stream (1, T/tp, C) is viewed as (T/tp, C) before its gather; the gather is still
    done again in the backward, not saved (it was saved whole, 1.34 GB of Llama-3-8B's 3.54 GB cut to 2 layers). And
    a row-parallel layer's output gradient is gathered once for both its input's and its weight's gradient (it was
    gathered a second time, transposed: 13 backward all-gathers here, now 9). Moving T to the front of a one-row
    stream for a collective leaves its memory as it is: no copy (there were 40 a forward on Llama-3-8B cut to
    2 layers, tp 8)."""
    pytest.importorskip("transformers")  # .ci/run's newest-torch stage installs no Hugging Face models
    from third_party import build, global_batch

    ids, labels, mask = (t[:1] for t in global_batch(0, 4))
    graphs = compile_under_tp(build("llama"), 2, ids, labels, mask, example_inputs=(ids, labels, mask),
                              sequence_parallel=True)
    forward = graphs["forward graph"].graph
    saved = [n for n in forward.output_node().args[0][1:] if isinstance(n, fx.Node)]
    c10d = torch.ops._c10d_functional
    assert not [n for n in saved if n.target is c10d.wait_tensor.default
                and n.args[0].target is c10d.all_gather_into_tensor.default]
    gathers = {label: sum(c.kind == "all_gather" for c in collectives(graphs[label]))
               for label in ("forward graph", "backward graph")}
    assert gathers["backward graph"] <= 2 * gathers["forward graph"] + 1, gathers
    sequence_collectives = (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default)
    assert not [n for n in forward.nodes if n.target is torch.ops.aten.clone.default
                and any(u.target in sequence_collectives for u in n.users)]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_hugging_face_llama_attention_runs_on_this_ranks_heads(sequence_parallel: bool) -> None:
    """HF Llama (RoPE, GQA, RMSNorm, a vocabulary-split embedding) under tp 2: each rank's attention reads its
    half of the heads, and no weight changes its split in the step. Before [Note: a reduction already made is
    free], the norm's output stayed a partial sum (or, under sequence parallel, was turned feature-split):
    q, k and v ran row-split (an all-to-all of each weight), then were all-reduced, and every rank ran every head."""
    pytest.importorskip("transformers")  # .ci/run's newest-torch stage installs no Hugging Face models
    from third_party import build, global_batch

    model = build("llama")
    heads = model.inner.config.num_attention_heads
    ids, labels, mask = global_batch(0, 4)
    graphs = compile_under_tp(model, 2, ids, labels, mask, example_inputs=(ids, labels, mask),
                              sequence_parallel=sequence_parallel)
    forward = graphs["forward graph"].graph
    attention = [n for n in forward.nodes if "scaled_dot_product" in str(n.target)]
    assert attention and all(n.args[0].meta["val"].shape[1] == heads // 2 for n in attention)
    moved = [c.kind for label in ("forward graph", "backward graph") for c in collectives(graphs[label])]
    assert "all_to_all" not in moved
    # The backward reduces each block input's gradient once (q, k and v's summed first; Megatron's f), and the LM
    # head's: 2 a layer + 1 (was 8 all-reduces without sp, 10 reduce-scatters with it, before the Note's rehearsal).
    # Under sp the first norm's variance term is reduced on its own: one more.
    layers = model.inner.config.num_hidden_layers
    activation_bytes = ids.numel() * model.inner.config.hidden_size * 4
    reductions = [c.kind for c in collectives(graphs["backward graph"]) if c.bytes == activation_bytes
                  and c.kind in ("all_reduce", "reduce_scatter")]
    assert reductions == (["reduce_scatter"] * (2 * layers + 2) if sequence_parallel else ["all_reduce"] * (2 * layers + 1))
