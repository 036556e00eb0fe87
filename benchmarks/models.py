"""The models the step-time sweep trains: our example GPT and Hugging Face Llama configs we did not tune."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, Block, GPTConfig  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


class LlamaLM(nn.Module):
    """A Hugging Face ``LlamaForCausalLM`` returning its own loss, as a user of ``labels=`` would."""

    def __init__(self, **config: int) -> None:
        super().__init__()
        import transformers as tf

        self.inner = tf.LlamaForCausalLM(tf.LlamaConfig(**config, max_position_embeddings=1024))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=labels, use_cache=False).loss

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.inner.model.layers)


class ExampleGPT(GPT):
    @property
    def blocks(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, Block)]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]  # a module with .blocks (FSDP2's units) and forward(ids, labels) -> loss
    vocab: int
    max_seq: int
    shifts_labels: bool  # the model shifts labels itself (Hugging Face), so labels are the ids


def _llama(hidden: int, layers: int, intermediate: int, vocab: int, heads: int) -> Callable[[], nn.Module]:
    return lambda: LlamaLM(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,
    )


MODELS = {
    spec.name: spec
    for spec in (
        ModelSpec("gpt-0.8m", lambda: ExampleGPT(GPTConfig()), GPTConfig().vocab_size, GPTConfig().block_size, False),
        ModelSpec("llama-4m", _llama(hidden=256, layers=4, intermediate=512, vocab=2048, heads=4), 2048, 1024, True),
        ModelSpec("llama-25m", _llama(hidden=512, layers=6, intermediate=1376, vocab=4096, heads=8), 4096, 1024, True),
    )
}


def batches(spec: ModelSpec, rows: int, seq: int, count: int, seed: int) -> list[Batch]:
    """Random token batches (ids, next-token labels); rank r passes seed + r, as a sampler would."""
    if seq > spec.max_seq:
        raise SystemExit(f"{spec.name} takes at most {spec.max_seq} tokens per row, asked for {seq}")
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, spec.vocab, (rows, seq), generator=generator)
        out.append((ids, ids if spec.shifts_labels else torch.roll(ids, -1, 1)))
    return out


def llama_25m() -> tuple[nn.Module, Batch]:
    """For ``dpar inspect benchmarks/models.py:llama_25m``: the model and one rank's 8x128 batch."""
    spec = MODELS["llama-25m"]
    return spec.build(), batches(spec, 8, 128, 1, seed=0)[0]
