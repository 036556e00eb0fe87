"""Context parallel (cp, ddp+cp, zero2+cp, fsdp+cp, and beside a tensor axis: cp+tp, fsdp+cp+tp, ...): each
sequence split over a "cp" axis, against torch DDP.

Models this project did not write (Hugging Face's Llama with a padding mask, nanoGPT and torchtitan's
Llama 3 with causal attention) train 5 AdamW steps; in float64 the parameters must equal torch DDP's on
the same slices to 1e-9 (rounding is ~1e-15 there; a wrong split, a label shifted across a chunk
boundary or a loss averaged per rank stays ~1e-3 or more). One case at 4,096 tokens per sequence.
The structure of the pass is read off its graphs in a fake world of 4 ranks; beside a tensor axis, each
axis's collectives are the ones it runs alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import dpar
import third_party
from distributed import run_ranks
from dpar.compiler.collectives import collectives
from dpar.core.plan import ATTENTION_EXCHANGES, Strategy, plan_of_model
from fake_world import fake_world
from gpt import GPT, GPTConfig
from third_party import Run, assert_figures, max_abs_diff, needs_torchtitan

FLOAT64 = 1e-9
FLOAT32 = 1e-4
RECOMPUTE = ("selective", "full")

# (model, strategy, mesh shape, rows per rank, tokens per row, ranks fed the same rows, float64[, inner compiler,
# attention exchange or activation policy])
TWO_RANKS = [
    ("llama", "cp", None, 2, 8, 1, True),
    ("llama", "cp", None, 2, 8, 1, False, "inductor"),  # Inductor's decompositions: the loss and embedding forms
    ("titan_llama3", "cp", None, 2, 8, 1, True),
    ("nanogpt_4k", "cp", None, 1, 4096, 1, True),
    # Ulysses: a padding mask whole beside grouped heads repeated (HF)
    ("llama", "cp", None, 2, 8, 1, True, "all_to_all"),
]
# Paths the cases above and the 4-rank launch cover: fp32 under aot_eager (Inductor's fp32 case), nanoGPT at 8 tokens
# (at 4,096), a cp group fed one batch (the planned zero2+cp case and the logits check), Inductor's lowering of the
# all-to-all exchange (of the ring's, and of the all-to-all under aot_eager).
TWO_RANKS_MORE = [
    ("llama", "cp", None, 2, 8, 1, False, "inductor", "all_to_all"),
    ("llama", "cp", None, 2, 8, 1, False),
    ("nanogpt", "cp", None, 2, 8, 1, True),
    ("llama", "cp", None, 2, 8, 2, True),  # same_batch_in_cp_group: one copy, each rank its chunks
    ("nanogpt", "cp", None, 2, 8, 1, True, "all_to_all"),
    ("llama", "cp", None, 2, 8, 1, True, "all_to_all", "full"),  # exchanged tensors saved, collectives not recomputed
    ("titan_llama3", "cp", None, 2, 8, 1, True, "all_to_all"),  # torchtitan's causal flag: the ring case's
]
FOUR_RANKS = [
    ("llama", "fsdp+cp", (2, 2), 2, 8, 1, True),
    ("llama", "cp+tp", (2, 2), 2, 8, 1, True, "all_to_all"),  # tp's 2 heads of 4, 1 a rank
]
# Both activation axes beside a sharded data axis: the layout torchtitan trains long sequences with.
EIGHT_RANKS = [("llama", "fsdp+cp+tp", (2, 2, 2), 2, 8, 1, True)]
# The other models and data modes under cp and tp, whose paths the cases above cover (HF Llama's cp+tp: the planned
# cp+tp case of the 4-rank launch).
FOUR_RANKS_MORE = [
    ("nanogpt", "cp", None, 1, 16, 1, True),  # cp 4, a chunk of 2 tokens: cp+tp's cp 2 and the cp-4 inspection
    ("llama", "ddp+cp", (2, 2), 2, 8, 1, True),  # replicated over dp: fsdp+cp's data axis, and the planned ddp/zero2+cp
    ("nanogpt", "cp", None, 1, 16, 1, True, "all_to_all"),  # one head a rank: cp+tp's one head a rank above
    ("llama", "cp+tp", (2, 2), 2, 8, 1, True),
    ("titan_llama3", "cp+tp", (2, 2), 2, 8, 1, True),
    ("nanogpt", "cp+tp", (2, 2), 2, 8, 1, True),
]
EIGHT_RANKS_MORE = [
    ("llama", "zero2+cp+tp", (2, 2, 2), 2, 8, 1, True),
    ("llama", "ddp+cp+tp", (2, 2, 2), 2, 8, 1, True),
    ("llama", "fsdp+cp+tp", (2, 2, 2), 2, 8, 1, True, "all_to_all"),
]


def _train_cases(rank: int, world_size: int, cases: list[tuple]) -> dict[str, float | str]:
    found: dict[str, float | str] = {}
    for model, strategy, mesh_shape, rows, seq, same, wide, *extra in cases:
        label = " ".join([f"{model} {strategy} {seq} tokens", *(["same_batch_in_cp_group"] if same > 1 else []), *extra,
                          *(["float64"] if wide else [])])
        options = tuple(("compiler", e) for e in extra if e not in (*ATTENTION_EXCHANGES, *RECOMPUTE))
        torch.set_default_dtype(torch.float64 if wide else torch.float32)
        torch._dynamo.reset()  # another sequence length of the same model code would be traced as a symbol
        kwargs = (("same_batch_in_cp_group", True),) if same > 1 else ()
        kwargs += tuple(("attention_exchange", e) for e in extra if e in ATTENTION_EXCHANGES)
        kwargs += tuple(("activation_checkpointing", e) for e in extra if e in RECOMPUTE)
        try:
            reference = third_party.train(rank, world_size, Run(model, "torch_ddp", rows=rows, seq=seq, same_rows_in=same))
            state = third_party.train(rank, world_size, Run(
                model, strategy, mesh_shape=mesh_shape, rows=rows, seq=seq, same_rows_in=same, parallelize_kwargs=kwargs,
                options=options))
            if rank == 0:
                found[label] = max_abs_diff(reference, state)
        except Exception as error:  # reported with the others' figures
            found[label] = f"{type(error).__name__}: {str(error)[:300]}"
        finally:
            torch.set_default_dtype(torch.float32)
    return found


def _check(found: dict[str, float | str], cases: list[tuple]) -> None:
    wide = {k: v for k, v in found.items() if k.endswith("float64")}
    assert_figures(wide, "context parallel vs torch DDP (float64)", FLOAT64, sum(c[6] for c in cases))
    narrow = {k: v for k, v in found.items() if not k.endswith("float64")}
    if narrow:
        assert_figures(narrow, "context parallel vs torch DDP (float32)", FLOAT32, len(narrow))


class _LossAndLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = third_party.build("llama")

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lm.inner(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        return out.loss, out.logits


def _logits_in_global_order(rank: int) -> tuple[float, float]:
    """HF Llama in float64, the cp group fed one batch: (max |logits - one process's|, max |gradient - one
    process's|) for loss + mean(logits^2), the logits coming back whole, in the sequence's order."""
    with third_party.float64_by_default():
        one, split = _LossAndLogits(), _LossAndLogits()
        dpar.parallelize(split, strategy="cp", same_batch_in_cp_group=True)
        compiled = torch.compile(split, backend="dpar", options={"compiler": "aot_eager"})
        batch = third_party.global_batch(0, 4, 16)
        (loss, logits), (cp_loss, cp_logits) = one(*batch), compiled(*batch)
        (loss + logits.square().mean()).backward()
        (cp_loss + cp_logits.square().mean()).backward()
        grads = max((a.grad - b.grad).abs().max().item() for a, b in zip(one.parameters(), split.parameters()))
        return (logits - cp_logits).abs().max().item(), grads


def _two_rank_launch(rank: int, world_size: int) -> tuple[dict[str, float | str], tuple[float, float]]:
    found = _train_cases(rank, world_size, TWO_RANKS)
    torch._dynamo.reset()
    return found, _logits_in_global_order(rank)


def test_context_parallel_matches_torch_ddp_on_two_ranks() -> None:
    """The cases above, and the logits HF Llama returns under cp equal one process's, in the sequence's order."""
    needs_torchtitan("titan_llama3")
    found, (logits, grads) = run_ranks(_two_rank_launch, 2, timeout_s=600)[0]
    _check(found, TWO_RANKS)
    assert logits <= FLOAT64 and grads <= FLOAT64, (logits, grads)


# (mesh dimension names, the global batch's rows, ranks fed the same rows) of the plans made and trained
PLANNED = [(("dp", "cp"), 2, 2),  # 2 rows for 4 ranks: each cp group fed one
           (("cp", "tp"), 4, 1)]  # every rank its own row, moved over both axes


def _planned(rank: int, world_size: int) -> list[tuple[str, bool, float]]:
    """HF Llama in float64 planned by ``dpar.plan`` on each mesh of PLANNED, applied by ``parallelize(plan=...)``:
    (its strategy, whether it feeds a cp group one batch, max |parameters - torch DDP's|) of each."""
    found = []
    with third_party.float64_by_default():
        for names, rows, same in PLANNED:
            torch._dynamo.reset()
            batch = third_party.global_batch(0, rows, 16)
            plan = dpar.plan(third_party.build("llama"), batch, mesh_shape=(2, 2), mesh_dim_names=names)
            run = dict(rows=rows // (world_size // same), seq=16, same_rows_in=same)
            reference = third_party.train(rank, world_size, Run("llama", "torch_ddp", **run))
            state = third_party.train(rank, world_size, Run("llama", plan.strategy, **run, parallelize_kwargs=(("plan", plan),)))
            found.append((plan.strategy, plan.same_batch_in_cp_group, max_abs_diff(reference, state) if rank == 0 else 0.0))
        return found


def _four_rank_launch(rank: int, world_size: int) -> tuple[dict[str, float | str], list[tuple[str, bool, float]]]:
    found = _train_cases(rank, world_size, FOUR_RANKS)
    torch._dynamo.reset()
    return found, _planned(rank, world_size)


@pytest.mark.extended
def test_more_context_parallel_cases_match_torch_ddp_on_two_ranks() -> None:
    _check(run_ranks(_train_cases, 2, TWO_RANKS_MORE, timeout_s=600)[0], TWO_RANKS_MORE)


def test_context_parallel_with_a_data_axis_matches_torch_ddp_on_four_ranks() -> None:
    """The cases above, and plans from ``dpar.plan`` with a cp axis (beside dp, beside tp), applied by
    ``parallelize(plan=...)``."""
    found, planned = run_ranks(_four_rank_launch, 4, timeout_s=600)[0]
    _check(found, FOUR_RANKS)
    for strategy, same_batch, gap in planned:
        print(f"planned {strategy} (same_batch_in_cp_group={same_batch}): max |dpar - torch DDP| = {gap:.2e} (float64)")
    (first, first_same, _), (second, second_same, _) = planned
    assert first.endswith("+cp") and first_same and second == "cp+tp" and not second_same, planned
    assert max(gap for _, _, gap in planned) <= FLOAT64


@pytest.mark.extended  # each pair of its axes trains by default: fsdp+cp and cp+tp on 4 ranks, fsdp+tp elsewhere
def test_context_tensor_and_data_axes_together_match_torch_ddp_on_eight_ranks() -> None:
    found = run_ranks(_train_cases, 8, EIGHT_RANKS, timeout_s=600)[0]
    _check(found, EIGHT_RANKS)


@pytest.mark.extended
def test_more_context_and_tensor_cases_match_torch_ddp() -> None:
    _check(run_ranks(_train_cases, 4, FOUR_RANKS_MORE, timeout_s=600)[0], FOUR_RANKS_MORE)
    _check(run_ranks(_train_cases, 8, EIGHT_RANKS_MORE, timeout_s=900)[0], EIGHT_RANKS_MORE)


# --- structure, in a fake world --------------------------------------------------------------------

SEQ, CP = 64, 4


def _graphs(model: nn.Module, *inputs: torch.Tensor, world: int = CP, **kwargs) -> dict[str, object]:
    with fake_world(world) as graphs:
        dpar.parallelize(model, strategy="cp", mesh=init_device_mesh("cpu", (world,)), **kwargs)
        torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(*inputs).backward()
        return {g.label: g.graph for g in graphs}


def _nano(seq: int = SEQ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=seq, n_layer=2, n_head=4, n_embd=32))
    ids = torch.randint(0, 64, (2, seq))
    return model, ids, ids.roll(-1, 1)


def test_each_rank_attends_with_its_two_chunks_against_gathered_keys() -> None:
    """One copy (the group fed one batch): every attention kernel runs on a chunk of seq / (2 cp) queries;
    per layer the forward all-gathers keys and values, the backward gathers them again and reduce-scatters
    their gradients (one reduce-scatter: nanoGPT's fused qkv); the loss is a sum and a count all-reduced, the
    parameters' gradients in one bucket; nothing else gathers activations (not the logits, not the positions'
    gradient)."""
    model, ids, targets = _nano()
    graphs = _graphs(model, ids, targets, same_batch_in_cp_group=True)
    forward, backward = graphs["forward graph"], graphs["backward graph"]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    queries = {n.args[0].meta["val"].shape[2] for n in forward.graph.nodes if n.target is flash}
    assert queries == {SEQ // (2 * CP)}
    kinds = lambda gm: [(c.kind, str(c.dtype)) for c in collectives(gm)]  # noqa: E731
    layers = 2
    assert kinds(forward).count(("all_gather", "torch.float32")) == 2 * layers
    assert kinds(forward).count(("all_reduce", "torch.float32")) == 2  # the loss's sum and count
    assert kinds(backward).count(("all_gather", "torch.float32")) == 2 * layers  # keys and values again
    assert kinds(backward).count(("reduce_scatter", "torch.float32")) == layers
    # The parameters' gradients, partial sums over the sequence, in one bucket (its 29,568 values), not 28 all-reduces.
    assert [(c.kind, c.shape) for c in collectives(backward) if c.kind == "all_reduce"] == [("all_reduce", ("29568",))]
    vocab_sized = [c for c in collectives(forward) if c.shape and c.shape[-1] == "64" and c.kind == "all_gather"]
    assert not vocab_sized, vocab_sized


def _exchange_kinds(seq: int, **kwargs) -> tuple[set[tuple[int, ...]], dict[str, list[str]]]:
    """nanoGPT at cp 4, the group fed one batch: the attention kernels' query shapes and the float32 collectives'
    kinds, forward and backward (the loss's and the gradients' all-reduces left out)."""
    model, ids, targets = _nano(seq)
    graphs = _graphs(model, ids, targets, same_batch_in_cp_group=True, **kwargs)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    queries = {tuple(n.args[0].meta["val"].shape) for n in graphs["forward graph"].graph.nodes if n.target is flash}
    return queries, {label: [c.kind for c in collectives(graphs[f"{label} graph"])
                             if c.kind != "all_reduce" and c.dtype == torch.float32] for label in ("forward", "backward")}


def test_attention_takes_the_all_to_all_exchange_where_it_moves_less() -> None:
    """[Note: two ways to exchange a sequence for attention], nanoGPT (4 heads, none grouped) at cp 4. Asked for
    ``all_to_all``, each kernel runs on one head over the whole sequence; a layer's forward exchanges queries, keys,
    values in and the output and log-sum-exp back (5 all-to-alls), its backward the output's gradient in and three
    gradients back (4), reusing the forward's; nothing is gathered. Left to the cost model, 64 tokens keep the
    gathers (2 collectives, where latency rules) and 2,048 tokens take the all-to-alls (1/4 of the bytes each)."""
    layers = 2
    queries, kinds = _exchange_kinds(SEQ, attention_exchange="all_to_all")
    assert queries == {(2, 4 // CP, SEQ, 8)}
    assert kinds == {"forward": ["all_to_all"] * 5 * layers, "backward": ["all_to_all"] * 4 * layers}, kinds
    _, short = _exchange_kinds(SEQ)
    assert set(short["forward"]) == {"all_gather"}, short
    queries, long = _exchange_kinds(2048)
    assert queries == {(2, 4 // CP, 2048, 8)} and long == kinds, long


def test_refusals_name_the_problem_before_the_first_step() -> None:
    model, ids, targets = _nano(SEQ)
    with pytest.raises(dpar.ContextParallelError, match=r"sequence length 60 is not divisible by 2 x cp = 8"):
        _graphs(model, ids[:, :60].contiguous(), targets[:, :60].contiguous())
    with fake_world(4):
        with pytest.raises(dpar.OptionsError, match=r"named \('dp', 'cp'\)"):
            dpar.parallelize(_nano()[0], strategy="fsdp+cp", mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")))
        with pytest.raises(dpar.OptionsError, match="same_batch_in_cp_group"):
            dpar.parallelize(_nano()[0], strategy="fsdp", same_batch_in_cp_group=True)
        with pytest.raises(dpar.OptionsError, match=r"sequence_parallel .* without a cp axis.*not 'cp\+tp'"):
            dpar.parallelize(_nano()[0], strategy="cp+tp", sequence_parallel=True)
        with pytest.raises(dpar.OptionsError, match=r"named \('cp', 'tp'\)"):
            dpar.parallelize(_nano()[0], strategy="cp+tp", mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "cp")))
    with pytest.raises(dpar.ContextParallelError, match=r"heads \(4\) are not divisible by cp = 8"):
        _graphs(_nano()[0], ids, targets, world=8, attention_exchange="all_to_all")
    with fake_world(4):
        with pytest.raises(dpar.OptionsError, match=r"attention_exchange must be one of \['all_gather', 'all_to_all'\]"):
            dpar.parallelize(_nano()[0], strategy="cp", attention_exchange="ring")
        with pytest.raises(dpar.OptionsError, match=r"attention_exchange .* strategy 'fsdp' splits no sequence"):
            dpar.parallelize(_nano()[0], strategy="fsdp", attention_exchange="all_to_all")
    with fake_world(8):
        with pytest.raises(dpar.OptionsError, match=r"needs a 3-D mesh \(dp, cp, tp\)"):
            dpar.parallelize(_nano()[0], strategy="fsdp+cp+tp", mesh=init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "cp")))


def _llama() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """HF Llama, 2 layers, 4 query heads over 2 key-value heads; one sequence of SEQ tokens (ids, labels, mask)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = third_party.HuggingFaceLM("llama")
    model.inner = tf.LlamaForCausalLM(config)
    ids = torch.randint(1, 64, (1, SEQ))
    return model, (ids, ids, torch.ones_like(ids))


def test_grouped_query_keys_and_values_are_gathered_before_their_repeat() -> None:
    """HF Llama with 2 key-value heads for 4 query heads: attention's keys and values are gathered as the 2 heads
    the projection made, not as the 4 that ``repeat_kv`` expands them to; the causal mask HF builds is built as
    this rank's rows only (no (seq, seq) value in the forward)."""
    model, inputs = _llama()
    graphs = _graphs(model, *inputs, same_batch_in_cp_group=True)
    forward = graphs["forward graph"]
    gathered = [math.prod(int(d) for d in c.shape) for c in collectives(forward)
                if c.kind == "all_gather" and c.dtype == torch.float32]
    assert gathered and set(gathered) == {SEQ // CP * 2 * 8}, gathered  # local tokens x 2 heads x head_dim 8
    whole = [n for n in forward.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
             and n.meta["val"].dim() >= 2 and tuple(n.meta["val"].shape[-2:]) == (SEQ, SEQ)]
    assert not whole, whole


NANO_TARGET = '''
import sys, torch
sys.path.insert(0, {examples!r})
from gpt import GPT, GPTConfig

def nano():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, 256))
    return GPT(GPTConfig(vocab_size=64, block_size=256, n_layer=2, n_head=4, n_embd=32)), (ids, ids.roll(-1, 1))
'''


def test_inspect_prints_the_gathers_and_about_a_quarter_of_the_activations_at_cp_4(tmp_path, capsys) -> None:
    """``dpar inspect --strategy cp -n 4``: the all-gathers of keys and values in the collective table; with
    ``--same-batch-in-cp-group`` (one batch per group) the activation peak is 0.38 of the default's at 256 tokens
    (each rank computing its chunks of every rank's batch: as much as one process on one batch; the default's peak
    was 2.41 MB, 1.36 since its backward gathers keys and values where it needs them: [Note: recomputation where it
    is needed]); with ``--attention-exchange all_to_all`` all-to-alls instead, and a lower peak."""
    from dpar.cli import main

    target = tmp_path / "nano.py"
    target.write_text(NANO_TARGET.format(examples=str(Path(__file__).resolve().parent.parent / "examples")))
    peaks = {}
    for flags in ([], ["--same-batch-in-cp-group"], ["--same-batch-in-cp-group", "--attention-exchange", "all_to_all"]):
        assert main(["inspect", f"{target}:nano", "-n", "4", "--strategy", "cp", "--device", "cpu", *flags]) == 0
        out = capsys.readouterr().out
        kinds = {k for k in ("all_gather", "reduce_scatter", "all_to_all") if f"│ {k} " in out}
        assert "cp on 4 ranks" in out and kinds == ({"all_to_all"} if len(flags) > 1
                                                    else {"all_gather", "reduce_scatter"}), kinds
        line = next(l for l in out.splitlines() if "activations (at the peak" in l)
        peaks[len(flags)] = int(line.split("│")[2].strip().replace(",", ""))
    assert peaks[1] <= 0.4 * peaks[0], peaks
    assert peaks[3] < peaks[1], peaks  # no layer's keys and values whole


def _kinds_by_axis(strategy: str, shape: tuple[int, ...], **kwargs) -> dict[str, object]:
    """The forward's and backward's collectives of HF Llama (one batch per group) under ``strategy`` in a fake
    world, counted by kind and the role of the axis whose group runs it; its attention kernels' (heads, queries)."""
    model, inputs = _llama()
    with fake_world(math.prod(shape)) as graphs:
        names = Strategy.parse(strategy).mesh_dim_names
        dpar.parallelize(model, strategy=strategy, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names),
                         example_inputs=inputs, **kwargs)
        role_of = {a.group_name: a.role.value for a in plan_of_model(model).axes}
        torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(*inputs).backward()
        found: dict[str, object] = {}
        for g in graphs:
            counts: dict[tuple[str, str], int] = {}
            for c in collectives(g.graph):
                if c.kind == "broadcast":  # the buffers, once over the world
                    continue
                key = (c.kind, role_of[c.group])
                counts[key] = counts.get(key, 0) + 1
            found[g.label] = counts
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        found["attention"] = {tuple(n.args[0].meta["val"].shape[1:3]) for g in graphs if g.label == "forward graph"
                              for n in g.graph.graph.nodes if n.target is flash}
        return found


def test_context_and_tensor_axes_compose_each_its_own_collectives() -> None:
    """HF Llama on cp 2 x tp 2: each attention kernel runs on tp's heads (2 of 4) and cp's share of the queries
    (seq / 2: HF's mask makes it a masked attention, not split by chunks); over "cp" the forward and the backward run exactly the collectives cp alone runs (keys and values
    gathered, their gradients reduce-scattered, the loss's sum and count, the gradient bucket), over "tp" exactly
    tp alone's, and nothing else (but the buffers' broadcast); the one saving: the loss's count of targets."""
    both = _kinds_by_axis("cp+tp", (2, 2), same_batch_in_cp_group=True, same_batch_in_tp_group=True)
    cp = _kinds_by_axis("cp", (2,), same_batch_in_cp_group=True)
    tp = _kinds_by_axis("tp", (2,), same_batch_in_tp_group=True)
    heads = {h for h, _ in tp["attention"]}
    queries = {q for _, q in cp["attention"]}
    assert heads == {2} and queries == {SEQ // 2} and both["attention"] == {(2, SEQ // 2)}, both["attention"]
    for graph in ("forward graph", "backward graph"):
        expected = {**cp[graph], **tp[graph]}
        if graph == "forward graph":  # tp's vocabulary-split loss counts the valid targets from the labels whole:
            expected[("all_reduce", "context")] -= 1  # cp's count of them is not all-reduced, only the loss
        assert both[graph] == expected, (graph, both[graph], cp[graph], tp[graph])
