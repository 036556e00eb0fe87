"""Activation checkpointing as part of the plan (``dpar.parallelize(..., activation_checkpointing=...)``).

The numbers: training with a policy that recomputes equals training without, bit for bit on CPU
in fp32 (torch.equal on every entry of the state dict, BatchNorm's running statistics included),
and torch DDP on the same slices within 1e-4. The memory: the forward's saved activations shrink
from keep to selective to full. The communication: no collective is added to the backward by the
recomputation (a sharded parameter is not gathered again for it).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import third_party
from dpar.core.plan import ActivationPolicy
from distributed import run_ranks
from fake_world import fake_world
from training import TOLERANCE

WORLD = 2
POLICIES = ("keep", "selective", "full")
BUDGET = 50_000  # bytes per rank the forward may save: HF llama's 2 blocks under fsdp, between selective and full

# (model, strategy, policies trained): every policy against the same strategy's "keep".
TRAINED = (
    ("llama", "fsdp", POLICIES),
    ("llama", "tp", ("keep", "full")),
    ("resnet", "ddp", ("keep", "full")),
)
# Other models on paths the cases above train (fsdp's gathers recomputed: Llama's; GPT-2 checkpointed under fsdp and
# tp by default in test_buffers_and_checkpointing and test_tensor_parallel_precision): `-m extended`.
TRAINED_MORE = (
    ("nanogpt", "fsdp", ("keep", "full")),
    ("gpt2", "zero2", ("keep", "selective")),
)


class DropoutBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


class DropoutNet(nn.Module):
    """Blocks with dropout on (p=0.25) in training mode: a random op inside every checkpointed block."""

    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DropoutBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def train_dropout(rank: int, strategy: str, policy: str, p: float = 0.25) -> dict:
    """5 AdamW steps of ``DropoutNet`` (dropout ``p``) under ``strategy`` and ``policy``, the same seeds every run."""
    import dpar

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DropoutNet()
    for block in model.layers:
        block.drop.p = p
    dpar.parallelize(model, strategy=strategy, activation_checkpointing=policy)
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # the dropout masks: each rank its own, the same with and without recompute
    for step in range(5):
        opt.zero_grad()
        compiled(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))).backward()
        opt.step()
    return dpar.checkpoint.full_state_dict(model)


def trained_rank(rank: int, world_size: int, cases: tuple) -> dict:
    """Every case of ``cases`` and torch DDP per model, in one process per rank; with TRAINED's, the budget's
    case and the dropout model."""
    results: dict = {"seconds": {}}
    for model, strategy, policies in cases:
        for policy in policies:
            torch._dynamo.reset()
            start = time.perf_counter()
            run = third_party.Run(model, strategy, lr=1e-2, parallelize_kwargs=(("activation_checkpointing", policy),))
            results[(model, strategy, policy)] = third_party.train(rank, world_size, run)
            results["seconds"][(model, strategy, policy)] = time.perf_counter() - start
    for model in dict.fromkeys(m for m, _, _ in cases):
        torch._dynamo.reset()
        results[(model, "torch_ddp")] = third_party.train(rank, world_size, third_party.Run(model, "torch_ddp", lr=1e-2))
    if cases != TRAINED:  # (a copy: the arguments reach the ranks pickled)
        return results
    torch._dynamo.reset()
    start = time.perf_counter()
    budget = (("activation_checkpointing", ActivationPolicy(budget_bytes=BUDGET)),)
    results[("llama", "fsdp", "budget")] = third_party.train(
        rank, world_size, third_party.Run("llama", "fsdp", lr=1e-2, parallelize_kwargs=budget))
    results["seconds"][("llama", "fsdp", "budget")] = time.perf_counter() - start
    for policy in ("keep", "full"):
        results[("dropout", "fsdp", policy)] = train_dropout(rank, "fsdp", policy)
    results[("dropout off", "fsdp", "full")] = train_dropout(rank, "fsdp", "full", p=0.0)
    return results


@functools.cache
def trained(cases: tuple) -> list[dict]:
    start = time.perf_counter()
    results = run_ranks(trained_rank, WORLD, cases, timeout_s=1200)
    extras = ", the budget's case and 3 dropout runs" if cases == TRAINED else ""
    print(f"trained {sum(len(p) for _, _, p in cases)} checkpointing cases, {len(cases)} torch DDP{extras} in "
          f"{time.perf_counter() - start:.0f} s")
    return results


def _bit_exact(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", [(m, s, p) for m, s, ps in TRAINED for p in ps if p != "keep"] + [("llama", "fsdp", "budget")]
                         + [pytest.param((m, s, p), marks=pytest.mark.extended) for m, s, ps in TRAINED_MORE
                            for p in ps if p != "keep"], ids=str)
def test_checkpointed_training_is_bit_exact_and_matches_torch_ddp(case: tuple[str, str, str]) -> None:
    model, strategy, policy = case
    launch = TRAINED if any(case[:2] == (m, s) for m, s, _ in TRAINED) else TRAINED_MORE
    result = trained(launch)[0]  # the full state dicts, as rank 0 gathers them
    got, keep = result[case], result[(model, strategy, "keep")]
    diff = third_party.max_abs_diff(got, result[(model, "torch_ddp")])
    print(f"{model} {strategy} {policy}: max |dpar - torch DDP| = {diff:.2e}, {result['seconds'][case]:.1f} s")
    assert _bit_exact(got, keep), case  # BatchNorm's running statistics included (resnet)
    assert diff <= TOLERANCE["adamw"], case


def test_dropout_is_saved_not_replayed_so_checkpointing_changes_no_number() -> None:
    result = trained(TRAINED)[0]  # one launch: functools.cache keys on the arguments as passed
    keep, full = result[("dropout", "fsdp", "keep")], result[("dropout", "fsdp", "full")]
    assert _bit_exact(full, keep)
    # The dropout did act: without it the same run trains to other numbers.
    assert third_party.max_abs_diff(full, result[("dropout off", "fsdp", "full")]) > 1e-3


# --- graphs: saved bytes and collectives, on a fake world of 2 ranks (one process) ---------------


def _saved_bytes(forward: fx.GraphModule) -> int:
    """Bytes of the values the forward computes and returns: its saved activations (and its loss)."""
    saved = {
        o for o in forward.graph.output_node().args[0]
        if isinstance(o, fx.Node) and o.op != "placeholder" and isinstance(o.meta.get("val"), torch.Tensor)
    }
    return sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in saved)


def _graphs(strategy: str, policy: str) -> dict[str, fx.GraphModule]:
    import dpar

    with fake_world(WORLD) as recorded:
        model = third_party.build("llama")
        example = third_party.rank_slice(third_party.global_batch(0, 2 * WORLD), 0, WORLD)
        dpar.parallelize(model, strategy=strategy, example_inputs=example, activation_checkpointing=policy)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        compiled(*example).backward()
        return {g.label.split(" (")[0]: g.graph for g in recorded}


from dpar.compiler.collectives import is_communication  # noqa: E402
from dpar.compiler.passes.recompute import BLOCK_KEY  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402


def recomputed_per_block(forward: fx.GraphModule, backward: fx.GraphModule) -> dict[str, int]:
    from dpar.compiler.passes.recompute import recomputed_per_block as count

    return count(forward, backward)


def _collective_kinds(gm: fx.GraphModule) -> list[str]:
    from dpar.compiler.collectives import collectives

    return sorted(c.kind for c in collectives(gm))


# ddp and zero2 by `-m extended`: fsdp's gathers and tp's all-reduces are the collectives a recomputation could repeat.
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.extended),
                                      pytest.param("zero2", marks=pytest.mark.extended), "fsdp", "tp"])
def test_saved_activations_shrink_and_no_collective_is_added(strategy: str) -> None:
    graphs = {policy: _graphs(strategy, policy) for policy in POLICIES}
    saved = {policy: _saved_bytes(g["forward graph"]) for policy, g in graphs.items()}
    print(f"llama {strategy}: bytes the forward saves, keep/selective/full: {saved}")
    assert saved["keep"] > saved["selective"] > saved["full"], saved
    keep = graphs["keep"]
    for policy in ("selective", "full"):
        got = graphs[policy]
        assert _collective_kinds(got["forward graph"]) == _collective_kinds(keep["forward graph"]), policy
        backward, kept = _collective_kinds(got["backward graph"]), _collective_kinds(keep["backward graph"])
        # The backward's collectives are keep's: zero2 keeps the gathered parameters for the backward, fsdp
        # gathers each once again there, as without checkpointing (the recomputed matmuls read those), and
        # tensor parallel's forward collectives stay in the forward under every policy, keep included
        # (keep_collectives_in_forward in passes/recompute.py).
        assert backward == kept, (policy, backward, kept)
        # No collective of the forward runs again in the backward, but fsdp's planned re-gathers.
        again = [n for n in got["backward graph"].graph.nodes if is_communication(n) and BLOCK_KEY in n.meta
                 and n.meta.get("recompute") is not CheckpointPolicy.MUST_RECOMPUTE]
        assert not again, (policy, again)
        recomputed = recomputed_per_block(got["forward graph"], got["backward graph"])
        print(f"llama {strategy} {policy}: ops of each block the backward computes again: {recomputed}")
        assert set(recomputed) == {"inner.model.layers.0", "inner.model.layers.1"}, recomputed


def test_a_budget_chooses_the_blocks_to_recompute_or_names_the_smallest_that_fits() -> None:
    import dpar
    from dpar.compiler.passes.recompute import CHOSEN_KEY, saved_bytes

    def compiled(budget: int) -> dict[str, fx.GraphModule]:
        with fake_world(WORLD) as recorded:
            model = third_party.build("llama")
            example = third_party.rank_slice(third_party.global_batch(0, 2 * WORLD), 0, WORLD)
            dpar.parallelize(model, strategy="fsdp", activation_checkpointing=ActivationPolicy(budget_bytes=budget))
            torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(*example).backward()
            return {g.label: g.graph for g in recorded}

    graphs = compiled(BUDGET)
    chosen = graphs["joint graph"].meta[CHOSEN_KEY]
    saved = saved_bytes(graphs["forward graph"])
    print(f"llama fsdp, budget {BUDGET:,} B: {chosen}, forward saves {saved:,} B")
    assert saved <= BUDGET
    assert {r for _, r in chosen.blocks} - {dpar.Recompute.KEEP}, chosen  # it had to recompute something
    with pytest.raises(dpar.ActivationPolicyError, match=r"raise the budget to at least [\d,]+"):
        compiled(1_000)


# --- bad input --------------------------------------------------------------------------------------


def test_policies_are_checked_before_anything_is_placed() -> None:
    import dpar

    model = third_party.build("llama")
    with pytest.raises(dpar.ActivationPolicyError, match=r"unknown activation policy 'ful'.*did you mean 'full'"):
        dpar.parallelize(model, strategy="ddp", activation_checkpointing="ful")
    with pytest.raises(dpar.ActivationPolicyError, match=r"no block 'layers\.7'; its blocks are: inner\.model\.layers\.0, "
                                                         r"inner\.model\.layers\.1"):
        dpar.parallelize(model, strategy="fsdp", activation_checkpointing={"layers.7": "full"})
    with pytest.raises(dpar.ActivationPolicyError, match="no blocks to checkpoint"):
        dpar.parallelize(nn.Linear(2, 2), strategy="ddp", activation_checkpointing="full")
    with pytest.raises(dpar.ActivationPolicyError, match="budget_bytes"):
        dpar.parallelize(model, strategy="ddp", activation_checkpointing=dpar.ActivationPolicy(budget_bytes=-1))
    with pytest.raises(dpar.ActivationPolicyError, match="expected one of"):
        dpar.parallelize(model, strategy="ddp", activation_checkpointing=3)
    assert dpar.placement.plan_of(model) is None  # nothing attached by a refused call
    with pytest.raises(dpar.ProcessGroupError):  # ddp with a policy needs the process group its plan names
        dpar.parallelize(model, strategy="ddp", activation_checkpointing="full")


def test_the_plan_carries_the_policy_and_the_joint_stage_lists_it() -> None:
    import dpar
    from dpar.compiler.pass_listing import PassListing
    from dpar.compiler.options import Options
    from dpar.core.plan import Recompute

    with fake_world(WORLD):
        model = third_party.build("llama")
        dpar.parallelize(model, strategy="fsdp", activation_checkpointing={"inner.model.layers.1": "selective"})
        plan = dpar.placement.plan_of(model)
        assert plan.activations.of_block("inner.model.layers.1") is Recompute.SELECTIVE
        assert plan.activations.of_block("inner.model.layers.0") is Recompute.KEEP
        listing = PassListing(plan, [], None, Options.parse({})).listing()
        assert listing["joint"][-1] == "tag_recompute", listing


def test_inspect_shows_the_policy_the_recomputed_ops_and_the_bytes_saved() -> None:
    import io

    from rich.console import Console

    import dpar
    from dpar.inspect.activations import activation_rows, print_activations

    model = third_party.build("llama")
    example = third_party.rank_slice(third_party.global_batch(0, 2 * WORLD), 0, WORLD)
    full = dpar.explain(model, example, world_size=WORLD, strategy="ddp", device="cpu", activation_checkpointing="full")
    keep = dpar.explain(model, example, world_size=WORLD, strategy="ddp", device="cpu")
    rows = activation_rows("full", full, keep)
    before, after = rows["saved_bytes"]
    assert before > after > 0, rows
    assert set(rows["recomputed"]) == {"inner.model.layers.0", "inner.model.layers.1"}, rows
    out = io.StringIO()
    print_activations(rows, Console(file=out, width=120))
    print(out.getvalue())
    assert "ops each block computes again" in out.getvalue() and f"{after:,}" in out.getvalue()


def test_blocks_are_found_in_a_model_compiled_through_a_wrapper_of_its_forward() -> None:
    """A Hugging Face CausalLM compiled directly: its decorated forward takes ``*args``, so Dynamo roots every module
    path at ``L['args'][0]``. Each decoder layer must still be a block of its own (read as ``[0]`` once, every node
    fell in one block ``L['args.0``: one checkpointed region, the whole forward recomputed at the start of the
    backward, and the peak barely lower than keeping everything), so ``full`` holds far fewer activations at the
    step's peak than ``keep``."""
    import transformers as tf

    import dpar
    from dpar.compiler.passes.recompute import BLOCK_KEY, module_path

    node = fx.Graph().placeholder("x")
    for root in ("L['self']", "L['args'][0]", "L['model']", "L__self__"):
        node.meta["nn_module_stack"] = {"a": (f"{root}.model.layers[1].mlp", nn.Module)}
        assert module_path(node) == "model.layers.1.mlp", root
    config = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(config)
    ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
    reports = {policy: dpar.explain(model, (ids,), world_size=WORLD, strategy="ddp", device="cpu",
                                    activation_checkpointing=policy) for policy in ("keep", "full")}
    joint = next(g for g in reports["full"].graphs if g.label == "joint graph").graph
    assert {n.meta[BLOCK_KEY] for n in joint.graph.nodes if BLOCK_KEY in n.meta} == {f"model.layers.{i}" for i in range(3)}
    keep, full = (reports[p].memory.activations for p in ("keep", "full"))
    print(f"activations at the peak: keep {keep:,} B, full {full:,} B")
    assert full < 0.6 * keep
