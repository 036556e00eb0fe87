"""Activation memory and step time per rank under context parallel 1, 2 and 4, at sequences of 4k, 8k and 16k tokens,
with either attention exchange.

    python benchmarks/context_parallel_memory.py     # about 30 minutes on 2 cores
    python benchmarks/context_parallel_memory.py --models nanogpt --seqs 4096 --degrees 1,2

The models are Hugging Face's Llama at a small hidden size (128, 4 heads, 2 key-value heads, MLP 256,
2 layers, vocabulary 512) and the example GPT at the same size (4 heads, no mask), one sequence per cp group, AdamW. cp 1 is the model on one process
(dpar's ddp at world size 1: the anchor); cp 2 and 4 run ``strategy="cp"`` on that many gloo ranks, every
rank fed the same sequence (``same_batch_in_cp_group=True``), so each holds its two chunks of it. Memory:
a profile of a warm step (peak_memory.py's reading): the activation peak is the step's peak of live tensor
bytes above what was live at its start (parameters, optimizer state). Beside it, cp 1's figure divided by
cp, the ideal; the memory model's figure (``dpar.explain``'s activation peak, counted on the same compiled
graphs in a fake world of cp ranks); and the step time, the median of three steps. Each cp degree runs both
attention exchanges (``attention_exchange``) in one launch, their steps taking turns. Rank 0's figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "examples")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, live_bytes, revision  # noqa: E402

VOCAB = 512
STEPS = 3


class Llama(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import transformers as tf

        torch.manual_seed(0)
        self.inner = tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1 << 15))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=ids, use_cache=False).loss


class NanoGPT(torch.nn.Module):
    """The example GPT at the same size (4 heads, none grouped; causal by the kernel's flag, no mask)."""

    def __init__(self) -> None:
        super().__init__()
        from gpt import GPT, GPTConfig

        torch.manual_seed(0)
        self.inner = GPT(GPTConfig(vocab_size=VOCAB, block_size=1 << 15, n_layer=2, n_head=4, n_embd=128))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids, ids.roll(-1, 1))


MODELS = {"llama": Llama, "nanogpt": NanoGPT}


def measure(rank: int, world_size: int, model_name: str, seq: int, exchanges: list[str]) -> dict[str, dict[str, float]]:
    """Per attention exchange (one model each; cp 1: one model, no exchange): the activation peak of a warm step
    and the median step time, the models taking turns step by step."""
    import dpar

    steps = {}
    for exchange in exchanges if world_size > 1 else ["-"]:
        model = MODELS[model_name]()
        if world_size > 1:
            dpar.parallelize(model, strategy="cp", same_batch_in_cp_group=True, attention_exchange=exchange)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))

        def step(compiled=compiled, optimizer=optimizer, ids=ids) -> None:
            compiled(ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # compiles
        steps[exchange] = step
    found = {}
    for exchange, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("warm step"):
                step()
        at_start, peak = live_bytes(prof, "warm step")
        found[exchange] = {"activation_mb": (peak - at_start) / 2**20, "seconds": []}
    for _ in range(STEPS):
        for exchange, step in steps.items():  # turns: the machine's drift falls on both
            dist.barrier() if world_size > 1 else None
            start = time.perf_counter()
            step()
            found[exchange]["seconds"].append(time.perf_counter() - start)
    return {e: {"activation_mb": f["activation_mb"], "step_s": statistics.median(f["seconds"])} for e, f in found.items()}


def modelled_mb(model_name: str, seq: int, cp: int, exchange: str | None) -> float:
    """``dpar.explain``'s activation peak per rank for the same model, batch, degree and exchange (ddp's for cp 1)."""
    import dpar

    ids = torch.randint(0, VOCAB, (1, seq))
    how = dict(strategy="cp", same_batch_in_cp_group=True, attention_exchange=exchange) if cp > 1 else dict(strategy="ddp")
    report = dpar.explain(MODELS[model_name](), (ids,), world_size=max(cp, 2), device="cpu", **how)
    return report.memory.activations / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,nanogpt")
    parser.add_argument("--seqs", default="4096,8192,16384")
    parser.add_argument("--degrees", default="1,2,4")
    parser.add_argument("--exchanges", default="all_gather,all_to_all")
    parser.add_argument("--out", default=str(RESULTS / "context_parallel_memory.md"))
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    degrees = [int(d) for d in args.degrees.split(",")]
    exchanges = args.exchanges.split(",")
    rows = []
    for model_name, seq in [(m, s) for m in args.models.split(",") for s in seqs]:
        base = None
        for cp in degrees:
            for exchange, found in run_ranks(measure, cp, model_name, seq, exchanges, timeout_s=1200)[0].items():
                base = found["activation_mb"] if cp == 1 else base
                ideal = f"{base / cp:,.1f}" if base is not None else "-"
                ratio = f"{found['activation_mb'] / base:.3f}" if base else "-"
                rows.append(f"| {model_name} | {seq:,} | {cp} | {exchange} | {found['activation_mb']:,.1f} | {ideal} | {ratio} | "
                            f"{modelled_mb(model_name, seq, cp, exchange if cp > 1 else None):,.1f} | {found['step_s']:.2f} |")
                print(rows[-1], flush=True)
    text = "\n".join([
        "# Context parallel: activation memory and step time per rank",
        "",
        f"`python benchmarks/context_parallel_memory.py` at {revision()}, {time.strftime('%Y-%m-%d')}, CPU gloo ranks "
        "(2 cores shared by all ranks). HF Llama (4 heads over 2 key-value heads, a causal mask it builds) and the "
        "example GPT (4 heads, the kernel's causal flag), hidden 128, 2 layers, vocabulary 512, one sequence per cp "
        "group (`same_batch_in_cp_group=True`); cp 1 is one process. Each cp degree runs both attention exchanges "
        "(`attention_exchange`: keys and values all-gathered, or Ulysses' all-to-all to heads), their steps taking turns.",
        "",
        "| model | sequence | cp | exchange | activation peak (MB) | cp 1 / cp (MB) | vs cp 1 | memory model (MB) | step (s) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ])
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
