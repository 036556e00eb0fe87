"""param_dtype / reduce_dtype: what the collectives carry, and a bf16 loss curve against fp32."""

from __future__ import annotations

import statistics

import pytest
import torch

import dpar
from distributed import run_ranks
from fake_world import fake_world
from gpt import GPT, GPTConfig, get_batch, load_corpus

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


def collectives_with(**precision) -> tuple[GPT, dict[str, list]]:
    with fake_world(4) as graphs:
        torch.manual_seed(0)
        model = GPT(TINY)
        dpar.parallelize(model, strategy="fsdp", **precision)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        idx = torch.randint(0, 256, (2, 16))
        compiled(idx, idx).backward()
        return model, {g.label: list(g.collectives) for g in graphs}


def test_bf16_gathers_half_the_bytes_and_fp32_reduce_scatters_as_asked() -> None:
    _, full = collectives_with()
    model, mixed = collectives_with(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for label in ("forward graph", "backward graph"):
        fp32_gathers = [c for c in full[label] if c.kind == "all_gather"]
        bf16_gathers = [c for c in mixed[label] if c.kind == "all_gather"]
        assert [c.dtype for c in bf16_gathers] == [torch.bfloat16] * len(fp32_gathers)
        assert [2 * c.bytes for c in bf16_gathers] == [c.bytes for c in fp32_gathers]
    fp32_scatters = [c for c in full["backward graph"] if c.kind == "reduce_scatter"]
    mixed_scatters = [c for c in mixed["backward graph"] if c.kind == "reduce_scatter"]
    assert [(c.dtype, c.bytes) for c in mixed_scatters] == [(c.dtype, c.bytes) for c in fp32_scatters]
    # Shards, their gradients (and so the optimizer state) stay float32.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


def test_bf16_reduce_dtype_defaults_to_the_compute_dtype() -> None:
    _, mixed = collectives_with(param_dtype=torch.bfloat16)
    assert {c.dtype for c in mixed["backward graph"] if c.kind == "reduce_scatter"} == {torch.bfloat16}


def loss_curve(rank: int, world_size: int, param_dtype: torch.dtype | None, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    dpar.parallelize(model, strategy="fsdp", param_dtype=param_dtype, reduce_dtype=torch.float32)
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data, generator = load_corpus(), torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        x, y = get_batch(data, 4, GPTConfig().block_size, generator)
        loss = compiled(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.float().item())
    return losses


@pytest.mark.slow
@pytest.mark.extended  # bf16 training against torch DDP by default: test_tensor_parallel_precision, the bf16 quickstart
def test_bf16_loss_curve_tracks_fp32_over_50_steps_of_the_example() -> None:
    fp32 = run_ranks(loss_curve, 2, None, 50, timeout_s=600)[0]
    bf16 = run_ranks(loss_curve, 2, torch.bfloat16, 50, timeout_s=600)[0]
    gaps = [abs(a - b) for a, b in zip(fp32, bf16)]
    windows = [abs(statistics.mean(fp32[i : i + 10]) - statistics.mean(bf16[i : i + 10])) for i in range(0, 50, 10)]
    print("fp32", [round(v, 3) for v in fp32[::10]], "bf16", [round(v, 3) for v in bf16[::10]])
    print("max step gap", round(max(gaps), 4), "10-step window gaps", [round(w, 4) for w in windows])
    # bf16 keeps 8 significand bits (relative rounding 2**-9 ~ 0.2%); through the logits and the
    # softmax of a loss near 3 nats one step's loss moves by up to a few tenths at 4 sequences per
    # rank. Same batches and initial weights: per step the curves differ by that noise; averaged
    # over 10 steps the noise shrinks and what remains would be drift, which must stay small. The
    # single-step bound depends on the CPU's bf16 kernels: 0.44 on this session's machine (at the
    # commit before it too), under 0.3 on an earlier one; the window bounds below are what matters.
    assert max(gaps) <= 0.5
    assert max(windows) <= 0.1 and statistics.mean(windows) <= 0.03  # within ~3% of the loss
    assert statistics.mean(bf16[-10:]) < bf16[0] - 1.5  # and bf16 training does learn
