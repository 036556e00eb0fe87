"""The memory model against measurement: a small HF Llama's peak activation bytes on 2 gloo ranks, as the
CPU allocator reports them during a steady-state step, against what ``dpar.explain`` models (ddp within 2 %,
fsdp within 25 %: see ``TOLERANCE``).

The benchmark (benchmarks/measured_vs_modelled.py) does the same for larger models, more strategies and
compute time; this is its smallest case. Peak activation: the most bytes live during the forward and
backward above what was live when the step began (parameters or shards, optimizer state), read from
``torch.profiler``'s allocator events (``benchmarks/harness.live_bytes``). Modelled: the report's
``Memory.step_peak`` (gathered parameters, activations and the gradients produced by the
peak) for the same model, batch, strategy and N = 2 on the cpu preset, which counts gloo's all-gather and
reduce-scatter buffers (``DeviceSpec.staged_collectives``: at this size fsdp's are a fifth of its peak).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from distributed import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import live_bytes, report_pairs  # noqa: E402

STRATEGIES = ("ddp", "fsdp")
# ddp's peak is the graphs' own, modelled to the byte; fsdp's moves with gloo's worker threads (when a gathered
# block and its staging buffer are freed relative to the main thread): 0.83-0.97 of measured across runs on
# the loaded 2-core machine, so its test allows 25 % (the benchmark reports the 15 % goal per row).
TOLERANCE = {"ddp": 0.02, "fsdp": 0.25}
ROWS, SEQ, VOCAB = 4, 128, 2048


def _llama() -> torch.nn.Module:
    import transformers as tf

    class LlamaLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)
            self.inner = tf.LlamaForCausalLM(config)

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=ids, labels=labels, use_cache=False).loss

    torch.manual_seed(0)
    return LlamaLM()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1000 * rank + step))
    return ids, ids


def _measure(rank: int, world_size: int) -> dict[str, int]:
    import dpar
    from torch.profiler import ProfilerActivity, profile, record_function

    peaks = {}
    for strategy in STRATEGIES:
        torch._dynamo.reset()
        model = dpar.parallelize(_llama(), strategy=strategy)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):  # the first compiles, the third is measured
            if step < 2:
                compiled(*_batch(rank, step)).backward()
            else:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    with record_function("forward+backward"):
                        compiled(*_batch(rank, step)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks[strategy] = live_bytes(prof, "forward+backward")[1]
    return peaks


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    ranks = run_ranks(_measure, 2, timeout_s=240)
    return {s: max(r[s] for r in ranks) for s in STRATEGIES}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_peak_activation_as_modelled(measured: dict[str, int], strategy: str) -> None:
    from dpar.compiler.memory import step_peak

    report = dpar_explain(strategy)
    # The cpu preset counts gloo's all-gather and reduce-scatter buffers ([Note: gloo stages its gathers and
    # reductions]); ddp's all-reduces have none.
    modelled = report.memory.step_peak
    unstaged = step_peak(report_pairs(report)).step
    assert modelled > unstaged if strategy == "fsdp" else modelled == unstaged
    ratio = modelled / measured[strategy]
    print(f"{strategy}: modelled {modelled:,} B, measured {measured[strategy]:,} B, ratio {ratio:.3f}")
    assert abs(ratio - 1) <= TOLERANCE[strategy], (
        f"{strategy}: modelled peak activation {modelled:,} B, measured {measured[strategy]:,} B (ratio {ratio:.3f})"
    )


def dpar_explain(strategy: str):
    import dpar

    return dpar.explain(_llama(), _batch(0, 2), world_size=2, strategy=strategy, device="cpu")
