"""Models and the training loop the pipeline-parallel tests share (one process and gloo ranks)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import dpar

STEPS = 5
ROWS_PER_RANK = 4
SEQ = 8
VOCAB = 64


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class HuggingFaceLogits(nn.Module):
    """A Hugging Face causal LM returning logits, with a user's loss outside it."""

    def __init__(self, name: str, layers: int) -> None:
        super().__init__()
        import transformers as tf

        small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4)
        if name == "llama":
            config = tf.LlamaConfig(**small, num_hidden_layers=layers, num_key_value_heads=2, max_position_embeddings=32)
            self.inner = tf.LlamaForCausalLM(config)
        elif name == "gpt2":  # tied embedding and head: the head's stage and the embedding's share it
            config = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=32,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            self.inner = tf.GPT2LMHeadModel(config)
        else:
            raise KeyError(name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, use_cache=False).logits


class TinyGPT(nn.Module):
    """The example GPT (tied head) returning logits."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        from gpt import GPT, GPTConfig

        self.inner = GPT(GPTConfig(block_size=16, n_layer=layers, n_head=2, n_embd=32, vocab_size=VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids)


class TorchtitanLogits(nn.Module):
    """torchtitan's Llama 3 debug model (its own layer count) returning logits. Its fused ``wqkv`` is saved as
    ``wq``/``wk``/``wv`` by its own state-dict hooks: entries named after no parameter."""

    def __init__(self) -> None:
        super().__init__()
        import third_party

        self.inner = third_party.build("titan_llama3").inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids)


def build(name: str, layers: int) -> nn.Module:
    torch.manual_seed(0)
    if name == "titan_llama3":
        return TorchtitanLogits()
    return TinyGPT(layers) if name == "gpt" else HuggingFaceLogits(name, layers)


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9) if name == "sgd" else torch.optim.AdamW(params, lr=1e-3)


def one_process(name: str, layers: int, optim: str, world_size: int) -> tuple[dict, list[float]]:
    """The reference: one process on the global batch (every rank's slice)."""
    model = build(name, layers)
    opt = optimizer(optim, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step, ROWS_PER_RANK * world_size)
        loss = token_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def pipelined(rank: int, world_size: int, name: str, layers: int, optim: str, schedule: str, stages: int,
              micro_batches: int, mesh_shape: tuple[int, ...] | None = None, dp_strategy: str = "ddp",
              mesh_names: tuple[str, ...] = ("dp", "pp"), **options,
              ) -> tuple[dict | None, list[float], list[float], dict[int, int]]:
    """Each rank fed its own slice; returns (full state on rank 0, losses, measured bubble per step,
    the most micro-batches each of this rank's stages held at once). ``options``: more of dpar.pipeline's."""
    model = build(name, layers)
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    x, y = batch(0, ROWS_PER_RANK * world_size)
    step = dpar.pipeline(model, token_loss, example_inputs=(x.chunk(world_size)[rank], y.chunk(world_size)[rank]),
                         stages=stages, micro_batches=micro_batches, schedule=schedule, mesh=mesh,
                         dp_strategy=dp_strategy, **options)
    opt = optimizer(optim, model.parameters())
    losses, bubbles = [], []
    for i in range(STEPS):
        x, y = batch(i, ROWS_PER_RANK * world_size)
        losses.append(step(x.chunk(world_size)[rank], y.chunk(world_size)[rank]).item())
        bubbles.append(step.measured_bubble())
        opt.step()
        opt.zero_grad()
    return dpar.checkpoint.full_state_dict(model), losses, bubbles, step.executor.peak_held


def torch_ddp(rank: int, world_size: int, name: str, layers: int, optim: str) -> dict | None:
    """The other anchor: torch DDP on the same per-rank slices (the whole state on rank 0, None elsewhere)."""
    from torch.nn.parallel import DistributedDataParallel

    model = build(name, layers)
    ddp = DistributedDataParallel(model)
    opt = optimizer(optim, model.parameters())
    for i in range(STEPS):
        x, y = batch(i, ROWS_PER_RANK * world_size)
        token_loss(ddp(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else None
