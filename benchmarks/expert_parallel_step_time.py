"""Step time and memory per rank of a ~100M-parameter mixture of experts under ep 1, 2 and 4, on 4 gloo ranks.

    python benchmarks/expert_parallel_step_time.py   # about 10 minutes on 2 cores
    python benchmarks/expert_parallel_step_time.py --modes ddp,fsdp,ep,tp --out .../expert_parallel_step_time_tp.md

The model is Hugging Face's Mixtral at 6 layers of 8 experts (hidden 512, expert width 1280, top-2): 102M
parameters, 94M of them in experts. Modes, every one dpar's on the same weights and batches with AdamW: ``ddp``
(every expert on every rank), ``fsdp`` (ep 1: experts sharded as ordinary weights over all 4 ranks), ``ddp+ep``
and ``fsdp+ep`` (a 2 x 2 mesh: ep 2, experts replicated or sharded over "dp"), ``ep`` (ep 4) and ``tp`` (tp 4:
attention split by heads, the experts spread over the tp axis by expert, no token exchanged). Each rank is fed its
own rows. Memory: a profile of the last warm-up
step (live tensor bytes at its start and its peak, peak_memory.py's reading) and the bytes of parameters,
gradients and optimizer state each rank holds. Then the modes take turns at the measured steps, so that load
from other users of the machine hits all of them alike. Beside them, ``dpar.explain``'s step time and memory
for the same mode on the "cpu" device preset (the cost model's prediction at 4 ranks). torch has no
expert-parallel layer of its own to compare with (torchtitan's needs its trainer and a GPU for grouped GEMMs in
bf16), so the anchor is the same model without expert parallelism (ddp, fsdp).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

import dpar

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, live_bytes, revision, turns  # noqa: E402

WORLD_SIZE = 4
MODES = ("ddp", "fsdp", "ddp+ep", "fsdp+ep", "ep", "tp")
DEFAULT_MODES = MODES[:5]  # all six in one run hold more than 24 GB on four ranks (every mode's trainer stays live)
EP_DEGREE = {"ddp": "1", "fsdp": "1", "ddp+ep": "2", "fsdp+ep": "2", "ep": "4", "tp": "4 (over tp)"}
VOCAB, SEQ = 4096, 128


def config():
    import transformers as tf

    return tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1280, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=SEQ,
    )


class Mixtral(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import transformers as tf

        torch.manual_seed(0)
        self.inner = tf.MixtralForCausalLM(config())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, labels=ids, use_cache=False).loss


def batches(rank: int, count: int, rows: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000)
    return [torch.randint(0, VOCAB, (WORLD_SIZE * rows, SEQ), generator=generator).chunk(WORLD_SIZE)[rank]
            for _ in range(count)]


def placed(mode: str, rows: int) -> torch.nn.Module:
    model = Mixtral()
    if mode in ("ddp+ep", "fsdp+ep"):
        dpar.parallelize(model, strategy=mode, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")))
    elif mode == "tp":
        dpar.parallelize(model, strategy=mode, example_inputs=(torch.zeros(rows, SEQ, dtype=torch.long),))
    elif mode != "ddp":
        dpar.parallelize(model, strategy=mode)
    return model


def local_bytes(tensors: Any) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    data = batches(rank, args.warmup + args.steps, args.rows)
    trainers, measured = {}, {}
    for mode in args.modes:
        torch._dynamo.reset()
        gc.collect()
        window = f"measured step ({mode})"
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = placed(mode, args.rows)
            runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for step in range(args.warmup):
                with record_function(window if step == args.warmup - 1 else "warm-up"):
                    runner(data[step]).backward()
                    state = (local_bytes(model.parameters()), local_bytes(p.grad for p in model.parameters() if p.grad is not None))
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        at_start, peak = live_bytes(prof, window)
        measured[mode] = dict(
            warmup_s=time.perf_counter() - start, at_step_start_bytes=at_start, peak_bytes=peak,
            parameter_bytes=state[0], gradient_bytes=state[1],
            optimizer_bytes=local_bytes(t for s in optimizer.state.values() for k, t in s.items() if k != "step"),
            step_ms=[],
        )
        trainers[mode] = (runner, optimizer)
        dist.barrier()
    for _, mode, window in turns(args.modes, args.rounds, args.steps, args.warmup):
        runner, optimizer = trainers[mode]
        dist.barrier()
        for ids in data[window]:
            start = time.perf_counter()
            runner(ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            measured[mode]["step_ms"].append((time.perf_counter() - start) * 1e3)
    return measured


def predicted(mode: str, rows: int) -> dict[str, float]:
    """dpar.explain's step time and per-rank bytes for ``mode`` at 4 ranks on the "cpu" preset."""
    model = Mixtral()
    ids = torch.zeros(rows, SEQ, dtype=torch.long)
    report = dpar.explain(model, (ids,), strategy=mode, world_size=WORLD_SIZE, device="cpu")
    memory = report.memory
    return dict(step_ms=report.timeline.step_time * 1e3,
                state_bytes=memory.parameters + memory.gradients + memory.optimizer,
                peak_bytes=memory.parameters + memory.gradients + memory.optimizer + memory.gathered + memory.activations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2, help="sequences of 128 tokens per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--modes", type=lambda text: tuple(text.split(",")), default=DEFAULT_MODES,
                        help=f"comma-separated, ddp first, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "expert_parallel_step_time.md")
    args = parser.parse_args()
    if args.modes[0] != "ddp" or not set(args.modes) <= set(MODES):
        parser.error(f"--modes: ddp first (the anchor), then any of {', '.join(MODES[1:])}; got {','.join(args.modes)}")
    started = time.strftime("%Y-%m-%d")
    ranks = run_ranks(run_rank, WORLD_SIZE, args, timeout_s=3000)
    parameters = sum(p.numel() for p in Mixtral().parameters())
    experts = sum(p.numel() for n, p in Mixtral().named_parameters() if ".experts." in n)
    lines = [
        "# Expert parallelism: step time and memory per rank (4 gloo ranks)", "",
        f"Measured {started} at {revision()}, torch {torch.__version__}, `python benchmarks/expert_parallel_step_time.py`"
        f" (2 CPU cores shared by the 4 ranks). HF Mixtral, 6 layers x 8 experts, top-2: {parameters / 1e6:.1f}M "
        f"parameters, {experts / 1e6:.1f}M in experts; {args.rows} x {SEQ} tokens per rank per step, AdamW, "
        f"{args.steps} measured steps per mode in {args.rounds} turns after {args.warmup} warm-up steps.", "",
        "| mode | ep | step (ms, median of ranks' medians) | spread (min-max of ranks) | vs ddp | state per rank (MB) | "
        "peak live (MB) | predicted step (ms, cpu preset) | predicted peak (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    medians = {m: [statistics.median(r[m]["step_ms"]) for r in ranks] for m in args.modes}
    for mode in args.modes:
        rank0 = ranks[0][mode]
        state = rank0["parameter_bytes"] + rank0["gradient_bytes"] + rank0["optimizer_bytes"]
        peak = max(r[mode]["at_step_start_bytes"] + r[mode]["peak_bytes"] for r in ranks)
        model = predicted(mode, args.rows)
        step = statistics.median(medians[mode])
        lines.append(
            f"| {mode} | {EP_DEGREE[mode]} | {step:,.0f} | {min(medians[mode]):,.0f}-{max(medians[mode]):,.0f} | "
            f"{step / statistics.median(medians['ddp']):.2f} | {state / 1e6:,.0f} | {peak / 1e6:,.0f} | "
            f"{model['step_ms']:,.1f} | {model['peak_bytes'] / 1e6:,.0f} |")
    lines += ["", "State: parameters, gradients and AdamW moments rank 0 holds (its shard or its experts). Peak live: "
              "the largest over ranks of the live tensor bytes at the measured step's peak."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
