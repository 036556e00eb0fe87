"""A small byte-level GPT trained on examples/data/corpus.txt, data parallel through dpar.

    torchrun --nproc-per-node 2 examples/gpt.py --steps 30   # two ranks (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 2 examples/gpt.py --strategy tp --sequence-parallel   # layers split over 2 ranks
    torchrun --nproc-per-node 2 --max-restarts 3 examples/gpt.py --resume ckpt --checkpoint-every 10
                                                             # restarted after a failure, it resumes exactly
    python examples/gpt.py --steps 5                         # one device: dpar warns and runs locally

Apart from creating the process group, the training loop is plain single-device
PyTorch: ``torch.compile(backend="dpar")`` is what makes it data parallel.
``default()`` is what ``dpar inspect examples/gpt.py`` compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dpar  # parallelize and the communication report; backend="dpar" alone needs no import
import dpar.compiler.registry

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape; the default (0.83M parameters) trains at about 20 steps/s on one CPU core."""

    vocab_size: int = 256  # bytes
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    fused_qkv: bool = True  # one (C, 3C) projection; False: separate q/k/v, which tensor parallel splits by heads


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}")
        self.n_head = config.n_head
        self.fused_qkv = config.fused_qkv
        if config.fused_qkv:
            self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        else:  # separate projections (as Llama has): tensor parallel splits each by heads
            self.q = nn.Linear(config.n_embd, config.n_embd)
            self.k = nn.Linear(config.n_embd, config.n_embd)
            self.v = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        if self.fused_qkv:  # (B, T, 3C) -> three (B, heads, T, head_dim) tensors
            qkv = self.qkv(x).view(batch, seq, 3, self.n_head, channels // self.n_head)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
        else:
            heads = lambda t: t.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2)
            q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, seq, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-LayerNorm: the residual stream is never normalised, which keeps deep stacks stable."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes.

    The LM head shares its weight with the token embedding, so one parameter
    receives gradient from both ends of the graph: a case a data-parallel
    compiler must reduce once, not twice.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small weights keep the initial logits near uniform: loss starts at ln(256) ~ 5.5.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) for ``idx`` (B, T), or the mean cross-entropy against ``targets``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def load_corpus() -> torch.Tensor:
    """The corpus as a 1-D tensor of byte values (long, ready for the embedding)."""
    return torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``x`` and the same windows shifted by one byte ``y`` (next-byte targets)."""
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
    return x, y


def default() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The default model and one batch of inputs, for ``dpar inspect examples/gpt.py``."""
    torch.manual_seed(0)
    config = GPTConfig()
    x, _ = get_batch(load_corpus(), 8, config.block_size, torch.Generator().manual_seed(0))
    return GPT(config), (x,)


def format_communication(per_step: dict[str, dict[str, int]]) -> str:
    """``{"all_reduce": {"count": 2, "bytes": ...}}`` -> ``all_reduce 2x 3.3 MB``."""
    if not per_step:
        return "none"
    return ", ".join(f"{kind} {c['count']}x {c['bytes'] / 1e6:.1f} MB" for kind, c in per_step.items())


# [Note: resuming exactly]
# A run restarted from a checkpoint continues bit for bit as if it had never stopped (on CPU; on GPUs
# as far as the kernels are deterministic) when it restores, beside the parameters and the optimizer
# that dpar.checkpoint holds, what else decides the next steps: the step number, each rank's data
# generator (the order of its batches) and torch's RNG (dropout). Those go into one small file per
# rank, written before the checkpoint is saved, so a published checkpoint always has its files. Each
# checkpoint is a directory of its own, step-NNNNNN; a save killed halfway leaves only a
# step-NNNNNN.partial-* directory that is never read (dpar.checkpoint.save publishes by a rename).
_STEP_DIRECTORY = re.compile(r"step-(\d+)")


def _checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:06d}"


def _rank_state_path(directory: Path, step: int, rank: int) -> Path:
    return directory / f"step-{step:06d}.rank{rank}.pt"


def save_checkpoint(
    directory: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator, rank: int
) -> None:
    """The checkpoint after ``step`` steps; the older ones go once it is published on every rank."""
    rank_state = {"step": step, "data": generator.get_state(), "torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():
        rank_state["cuda_rng"] = torch.cuda.get_rng_state()
    file = _rank_state_path(directory, step, rank)
    torch.save(rank_state, f"{file}.tmp")
    os.replace(f"{file}.tmp", file)
    dpar.checkpoint.save(model, optimizer, _checkpoint_path(directory, step))  # returns once published
    if rank == 0:  # every rank has published this one: the older ones (and any save killed halfway) can go
        for path in directory.glob("step-*"):
            if int(path.name[len("step-") :].split(".")[0]) >= step:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def latest_step(directory: Path) -> int | None:
    """The last step whose checkpoint was published, or None."""
    steps = [
        int(match.group(1))
        for path in (directory.iterdir() if directory.is_dir() else ())
        if path.is_dir() and (match := _STEP_DIRECTORY.fullmatch(path.name))
    ]
    return max(steps, default=None)


def resume(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator, rank: int
) -> int:
    """Load the last checkpoint in ``directory`` (if any) and return the number of steps it holds."""
    step = latest_step(directory)
    if step is None:
        return 0
    dpar.checkpoint.load(model, optimizer, _checkpoint_path(directory, step))
    rank_state = torch.load(_rank_state_path(directory, step, rank))
    generator.set_state(rank_state["data"])
    torch.set_rng_state(rank_state["torch_rng"])
    if "cuda_rng" in rank_state:
        torch.cuda.set_rng_state(rank_state["cuda_rng"])
    return rank_state["step"]


def fail_once(directory: Path, step: int, rank: int) -> None:
    """Kill this process (SIGKILL: no cleanup, as the OOM killer or a lost host) the first time only: a
    marker in the checkpoint directory keeps a restarted run, which replays the steps since the last
    checkpoint, from killing itself again."""
    marker = directory / f"failed-at-step-{step}"
    if marker.exists():
        return
    marker.write_text(f"rank {rank} killed itself in the middle of step {step}\n")
    print(f"rank {rank}: --fail-at-step {step}: SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument(
        "--compiler",
        choices=("aot_eager", "inductor", "eager"),
        default="aot_eager",
        help="dpar's inner compiler (Inductor compiles for about a minute on a small CPU)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="gradient bucket size: ddp's (default 25), or zero2/fsdp's (default one bucket per block)",
    )
    parser.add_argument(
        "--strategy",
        choices=("ddp", "zero2", "fsdp", "tp", "pipeline"),
        default="ddp",
        help="ddp replicates; zero2/fsdp shard parameters, gradients and optimizer state; tp splits "
        "layers (Megatron); pipeline puts consecutive blocks on each rank (one stage per rank). Every strategy "
        "feeds each rank its own batches, as DDP does. All but ddp need torchrun",
    )
    parser.add_argument(
        "--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"), default="1f1b",
        help="pipeline: the schedule (interleaved_1f1b and zbv run two stages on each rank)",
    )
    parser.add_argument(
        "--micro-batches", type=int, default=None,
        help="pipeline: micro-batches per step (default 4 x the stages, which keeps the bubble small)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="tp: keep norms and the residual stream split along the sequence (Megatron-SP)",
    )
    parser.add_argument(
        "--param-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="zero2/fsdp: dtype parameters are gathered and computed in (gradients reduced in float32)",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="checkpoint directory: resume from its last checkpoint if it has one (the same command line "
        "serves the first start and every restart, as torchrun --max-restarts runs it)",
    )
    parser.add_argument("--checkpoint-every", type=int, metavar="K", help="save a checkpoint into --resume DIR every K steps")
    parser.add_argument(
        "--fail-at-step",
        type=int,
        metavar="K",
        help="fault injection: the last rank SIGKILLs itself in the middle of step K, once per --resume DIR",
    )
    args = parser.parse_args()
    if (args.checkpoint_every is not None or args.fail_at_step is not None) and args.resume is None:
        parser.error("--checkpoint-every and --fail-at-step need a checkpoint directory: add --resume DIR")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        parser.error("--checkpoint-every must be at least 1")
    if args.sequence_parallel and args.strategy != "tp":
        parser.error("--sequence-parallel splits activations between tensor-parallel layers: add --strategy tp")
    if args.bucket_cap_mb is not None and args.strategy == "tp":
        parser.error("--bucket-cap-mb: tp has no gradient buckets")
    if args.strategy == "pipeline" and args.resume is not None:
        parser.error("--resume: dpar.checkpoint does not save pipeline stages yet; export with "
                     "dpar.checkpoint.full_state_dict instead")
    return args


def main() -> None:
    args = parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1

    # The same seed everywhere gives identical replicas (dpar also broadcasts rank 0's at compile).
    torch.manual_seed(args.seed)
    tensor_parallel = args.strategy == "tp"
    config = GPTConfig(fused_qkv=not tensor_parallel)  # separate q/k/v: tensor parallel splits them by heads
    model = GPT(config).to(device)
    data = load_corpus()
    # Every strategy: each rank its own batches (dpar moves the rows a tensor-parallel group needs).
    generator = torch.Generator().manual_seed(args.seed + rank)
    if tensor_parallel:
        example = get_batch(data, args.batch_size, config.block_size, torch.Generator().manual_seed(args.seed))[0]
        dpar.parallelize(
            model, strategy="tp", example_inputs=(example.to(device),), sequence_parallel=args.sequence_parallel
        )
    elif args.strategy not in ("ddp", "pipeline"):
        param_dtype = getattr(torch, args.param_dtype)
        dpar.parallelize(
            model, strategy=args.strategy, param_dtype=param_dtype, reduce_dtype=torch.float32,
            bucket_cap_mb=args.bucket_cap_mb,
        )
    options = {"compiler": args.compiler}
    if args.strategy == "ddp" and args.bucket_cap_mb is not None:
        options["bucket_cap_mb"] = args.bucket_cap_mb  # ddp sizes its buckets when compiling
    if args.strategy == "pipeline":  # the backward runs inside the step: model(x, y) + backward below
        stages = world_size * (2 if args.schedule in ("interleaved_1f1b", "zbv") else 1)
        x, y = get_batch(data, args.batch_size, config.block_size, torch.Generator().manual_seed(args.seed))
        pipelined = dpar.pipeline(
            model, lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten()),
            example_inputs=(x.to(device), y.to(device)), stages=stages, schedule=args.schedule,
            micro_batches=args.micro_batches or 4 * stages,
            compiler="inductor" if args.compiler == "inductor" else "aot_eager",  # stage graphs as Python otherwise
        )
        if rank == 0:
            print(pipelined.split)
    else:
        model = torch.compile(model, backend="dpar", options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.resume is not None:
        args.resume.mkdir(parents=True, exist_ok=True)
        start = resume(args.resume, model, optimizer, generator, rank)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"world size {world_size}, device {device}, {params / 1e6:.2f}M parameters, {config}")
        if start:
            print(f"resumed from {_checkpoint_path(args.resume, start)}")

    tokens_per_step = args.batch_size * config.block_size * world_size
    logged_step, logged_at = start, 0.0  # steps done at the last log, and when
    loss_sum = torch.zeros((), device=device)  # since the last log; summed on the device, no sync per step
    with dpar.compiler.registry.recording() as graphs:  # what dpar compiles, for comm/step
        for step in range(start, args.steps):
            x, y = (t.to(device) for t in get_batch(data, args.batch_size, config.block_size, generator))
            if args.strategy == "pipeline":
                loss = pipelined(x, y)  # forward and backward of every rank's rows, the mean loss
            else:
                loss = model(x, y)
                if step + 1 == args.fail_at_step and rank == world_size - 1:
                    fail_once(args.resume, step + 1, rank)  # after the forward: the others are in the backward
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
            if args.checkpoint_every is not None and (step + 1) % args.checkpoint_every == 0:
                save_checkpoint(args.resume, step + 1, model, optimizer, generator, rank)
            if step != start and (step + 1) % args.log_every and step != args.steps - 1:
                continue
            if distributed:  # every rank's batches, not only rank 0's (a sum: gloo has no AVG)
                dist.all_reduce(loss_sum)
            steps = step + 1 - logged_step
            mean_loss = loss_sum.item() / (world_size * steps)
            now = time.perf_counter()  # after .item(), which waits for the device
            # The first step compiles and always logs alone: tokens/s counts from the next.
            throughput = f"{tokens_per_step * steps / (now - logged_at):,.0f}" if logged_at else "-"
            if rank == 0 and args.strategy == "pipeline":
                print(f"step {step + 1:4d}  loss {mean_loss:.4f}  tokens/s {throughput}  "
                      f"bubble {pipelined.measured_bubble():.0%} (rank 0, last step)")
            elif rank == 0:
                comm = format_communication(dpar.compiler.registry.communication_per_step(graphs))
                print(f"step {step + 1:4d}  loss {mean_loss:.4f}  tokens/s {throughput}  comm/step {comm}")
            logged_step, logged_at = step + 1, time.perf_counter()
            loss_sum.zero_()

    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
