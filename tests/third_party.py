"""Models this project did not write (Hugging Face configs, nanoGPT-style), trained the way a user would.

Every rank is fed its own slice of the global batch (DistributedSampler's contract), and
the parameters after a few steps are compared with torch DDP on the same slices. Nothing
is downloaded: the Hugging Face models are built from small random configs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

STEPS = 5
ROWS_PER_RANK = 2
SEQ = 8
VOCAB = 64


def _config(name: str):
    import transformers as tf

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4)
    if name == "llama":
        return tf.LlamaConfig(**small, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=32)
    if name == "bert":
        return tf.BertConfig(**small, num_hidden_layers=2, max_position_embeddings=32, type_vocab_size=1)
    if name == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    if name == "t5":
        return tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    if name == "mixtral":
        return tf.MixtralConfig(
            **small, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=32,
        )
    raise KeyError(name)


def _hf(name: str) -> nn.Module:
    """Dropout off everywhere, also where a model calls F.dropout with a rate from its config
    (T5's attention): with it on, ranks draw different masks than DDP and only statistics compare."""
    import transformers as tf

    config = _config(name)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(config, key, 0.0)
    model_class = {
        "llama": tf.LlamaForCausalLM, "bert": tf.BertForMaskedLM, "gpt2": tf.GPT2LMHeadModel,
        "t5": tf.T5ForConditionalGeneration, "mixtral": tf.MixtralForCausalLM,
    }[name]
    return model_class(config)


class HuggingFaceLM(nn.Module):
    """Returns the model's own loss, as a user of ``labels=`` would."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.inner = _hf(name)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.name == "t5":
            return self.inner(input_ids=ids, attention_mask=mask, labels=labels).loss
        if self.name == "bert":
            return self.inner(input_ids=ids, attention_mask=mask, labels=labels).loss
        return self.inner(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss


HF_MODELS = ("llama", "bert", "gpt2", "t5", "mixtral")


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return HuggingFaceLM(name)


def global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, attention mask): the mask pads a different number of tokens per row."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    for row in range(rows):
        mask[row, SEQ - (row % 3):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, labels, mask


def rank_slice(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(world_size)[rank] for t in batch)


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    strategy: str  # "torch_ddp" for the reference
    optimizer: str = "adamw"
    mesh_shape: tuple[int, ...] | None = None  # 2-D strategies: (dp, tp) or (replicate, shard)
    parallelize_kwargs: tuple[tuple[str, object], ...] = ()


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.AdamW(params, lr=1e-3)


def train(rank: int, world_size: int, run: Run, prepare: Callable[[nn.Module], None] | None = None) -> dict:
    """Train ``run.model`` for STEPS on this rank's slices; the full state dict (rank 0's view)."""
    import dpar
    from torch.distributed.device_mesh import init_device_mesh

    model = build(run.model)
    if prepare is not None:
        prepare(model)
    if run.strategy == "torch_ddp":
        runner = nn.parallel.DistributedDataParallel(model)
    else:
        kwargs = dict(run.parallelize_kwargs)
        if run.mesh_shape is not None:
            names = ("replicate", "shard") if run.strategy == "hsdp" else ("dp", "tp")
            kwargs["mesh"] = init_device_mesh("cpu", run.mesh_shape, mesh_dim_names=names)
        example = rank_slice(global_batch(0, ROWS_PER_RANK * world_size), rank, world_size)
        dpar.parallelize(model, strategy=run.strategy, example_inputs=example, **kwargs)
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    opt = _optimizer(run.optimizer, [p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        opt.zero_grad()
        ids, labels, mask = rank_slice(global_batch(step, ROWS_PER_RANK * world_size), rank, world_size)
        runner(ids, labels, mask).backward()
        opt.step()
    if run.strategy == "torch_ddp":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state = dpar.checkpoint.full_state_dict(model)
    dist.barrier()
    return state


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
