"""Peak resident memory per rank of a model born on meta, loaded in shards and trained, against the ZeRO formula and FSDP2.

    python benchmarks/born_sharded_memory.py                  # the 450M Llama on 4 gloo ranks (about 7 GB of
                                                              # replicated fp32 AdamW state); writes the results file
    python benchmarks/born_sharded_memory.py --size small     # a 21M one, to try the benchmark out
    python benchmarks/born_sharded_memory.py --pipeline       # also dpar.pipeline (4 stages) born on meta

An HF ``LlamaForCausalLM`` config (untied embeddings) is built on the meta device on every rank, and no rank ever
holds the whole model, not even to write the weights: one setup run builds it on meta, shards it (fsdp),
``to_empty``s it, initializes it (``torch.manual_seed(0); dpar.init_weights(model)``) and writes a DCP checkpoint
(``dpar.checkpoint.save``) and a Hugging Face safetensors directory (``dpar.checkpoint.save_safetensors``, shard
files of 256 MB, rank 0 holding one file's worth). Then each case runs in fresh processes, so each rank's peak
resident memory (``getrusage(RUSAGE_SELF).ru_maxrss``) is that case's: build on meta, parallelize (dpar: fsdp,
zero2, tp through ``dpar.parallelize`` + ``torch.compile(backend="dpar")``; torch FSDP2: ``fully_shard`` on each
decoder layer, then the root), ``to_empty(device="cpu")``, load the weights (a: the DCP checkpoint, ``dpar.checkpoint
.load``, or ``dcp.load`` into ``model.state_dict()`` for FSDP2; b: the safetensors directory,
``dpar.checkpoint.load_safetensors``, which also reads into FSDP2's DTensors), and train 3 AdamW steps of 1 row x 64
tokens per rank. Resident memory is read after each phase (VmRSS) and the peak so far (ru_maxrss), so a peak can be
placed in its phase. The step-1 loss of each rank must agree across every case (the same weights loaded every way).

The formula per rank (P parameters, fp32: 4 bytes each for the parameter, its gradient and AdamW's two moments;
N = 4 ranks): fsdp 16P/N; zero2 (parameters sharded at rest, as fsdp, but kept gathered from the forward to the
backward) 16P/N + 4P during the step; tp 16P_split/N + 16P_replicated (dpar's Megatron plan splits every Linear
but keeps an untied embedding and the norms whole); each plus one block, the largest module
gathered whole (a decoder layer, or the embedding/output matrix), parameter and gradient (8 bytes a parameter).
The baseline (``torch``, ``transformers`` and ``dpar`` imported, the process group up) is subtracted.

[Note: resident memory is not live tensors]
glibc's malloc raises its mmap threshold (up to 32 MiB) each time a large mmapped block is freed, after which blocks
of that size come from the heap, whose free space it keeps (and fragments) rather than returning: the peak resident
memory then measures the allocator's history as much as the tensors alive at once (a 8.4M-parameter fsdp model on
2 ranks grew 190 MiB with glibc's defaults, 98 MiB with a fixed threshold, FSDP2 79 MiB, for 72 MiB of formula).
So the ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` (a fixed threshold, as for every tensor over 128 KiB: each
is mmapped and returned when freed), unless ``--glibc-defaults``; the results file says which.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, revision  # noqa: E402

WORLD_SIZE = 4
STEPS = 3
ROWS, SEQ = 1, 64  # per rank
SIZES = {  # LlamaForCausalLM configs: few wide layers (compile time on a 2-core machine), untied embeddings
    "450m": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=6, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000),
    "230m": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000),  # zero2 on 4 ranks within the memory budget
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=8000),
}
DPAR = ("fsdp", "zero2", "tp")
WAYS = ("dcp", "safetensors")
PREFIX = "inner."
MMAP_THRESHOLD = 131072  # bytes; see [Note: resident memory is not live tensors]
OVERHEAD_BYTES = 1 << 30  # per rank, beside the formula: torch, dpar, the compiled graphs (measured: 0.9-1.0 GiB)  # where the HF model sits in the wrapper


def _config(size: str):
    import transformers as tf

    return tf.LlamaConfig(**SIZES[size], max_position_embeddings=SEQ, tie_word_embeddings=False)


class LM(nn.Module):
    """The HF model's own loss (``labels=``); with ``logits_only`` its logits, for ``dpar.pipeline``'s loss_fn."""

    def __init__(self, config: Any, logits_only: bool = False) -> None:
        super().__init__()
        import transformers as tf

        self.inner = tf.LlamaForCausalLM(config)
        self.logits_only = logits_only

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.logits_only:
            return self.inner(input_ids=ids, use_cache=False).logits
        return self.inner(input_ids=ids, labels=labels, use_cache=False).loss


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal LM loss (shifted by one token), for the pipeline's last stage."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _batch(rank: int, step: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))


def _rss() -> int:
    """Resident bytes now."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _peak() -> int:
    """Peak resident bytes of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _init_rotary(model: nn.Module) -> None:
    """HF's rotary ``inv_freq`` is a non-persistent buffer (in no checkpoint): the model's own init, after to_empty."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            model.inner._init_weights(module)


def _setup(rank: int, world_size: int, size: str, dcp_dir: str, st_dir: str) -> dict[str, Any]:
    """Born on meta under fsdp, initialized like one device, written both ways: no rank holds the whole model."""
    import dpar

    config = _config(size)
    with torch.device("meta"):
        model = LM(config)
    ids = _batch(rank, 0, config.vocab_size)
    dpar.parallelize(model, strategy="fsdp", example_inputs=(ids, ids))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    dpar.init_weights(model)
    dpar.checkpoint.save(model, None, dcp_dir)
    dpar.checkpoint.save_safetensors(model, st_dir, max_shard_size="256MB", prefix=PREFIX, config=config)
    return {"peak_bytes": _peak()}


def _fully_shard(model: LM) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.inner.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _case(rank: int, world_size: int, size: str, strategy: str, way: str, dcp_dir: str, st_dir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    import transformers  # noqa: F401  (in the baseline, with dpar)

    import dpar

    phases: dict[str, dict[str, int]] = {}

    def mark(phase: str) -> None:
        phases[phase] = {"rss_bytes": _rss(), "peak_bytes": _peak()}

    mark("baseline")
    config = _config(size)
    pipelined = strategy == "pipeline"
    with torch.device("meta"):
        model = LM(config, logits_only=pipelined)
    ids = _batch(rank, 0, config.vocab_size)
    step_fn = None
    if strategy == "fsdp2":
        _fully_shard(model)
    elif pipelined:
        step_fn = dpar.pipeline(model, _token_loss, example_inputs=(ids, ids), stages=world_size,
                                micro_batches=world_size)
    else:
        dpar.parallelize(model, strategy=strategy, example_inputs=(ids, ids))
    mark("parallelized on meta")
    model.to_empty(device="cpu")
    _init_rotary(model)
    mark("to_empty")
    if way == "dcp":
        if strategy == "fsdp2":  # the DCP checkpoint dpar wrote: its model entries, read into FSDP2's shards
            from dpar.runtime.checkpoint_files import published

            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=published(dcp_dir))
            model.load_state_dict(state["model"])
        else:
            dpar.checkpoint.load(model, None, dcp_dir)
    else:
        dpar.checkpoint.load_safetensors(model, st_dir, prefix=PREFIX)
    mark("loaded")
    if pipelined:
        runner = None
    elif strategy == "fsdp2":
        runner = model  # eager: FSDP2's own hooks
    else:
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    losses, seconds = [], []
    for step in range(STEPS):
        started = time.perf_counter()
        ids = _batch(rank, step, config.vocab_size)
        if pipelined:
            loss = step_fn(ids, ids)
        else:
            loss = runner(ids, ids)
            mark(f"step {step + 1} forward")
            loss.backward()
            mark(f"step {step + 1} backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - started)
        mark(f"step {step + 1}")
    return {"phases": phases, "losses": losses, "seconds": seconds,
            "parameters": sum(p.numel() for p in model.inner.parameters()) if strategy == "fsdp2" else None}


def _counts(size: str) -> dict[str, int]:
    """P, the parameters dpar's tp plan leaves whole (the untied embedding, the norms), and the largest block's: a decoder layer, or the root's rest
    (embedding, final norm, output matrix), which dpar's per-block buckets and FSDP2's root group both gather as one."""
    with torch.device("meta"):
        model = LM(_config(size))
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    from dpar.compiler.megatron import megatron_dims  # dpar's tp plan: untied embeddings and norms stay whole

    ids = torch.zeros(ROWS, SEQ, dtype=torch.long)
    replicated_tp = sum(named[n].numel() for n, dim in megatron_dims(model, (ids, ids)).items() if dim is None)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.inner.model.layers]
    return {"parameters": total, "tp_replicated": replicated_tp, "largest_block": max(*layers, total - sum(layers))}


def formulas(counts: dict[str, int], n: int) -> dict[str, dict[str, int]]:
    """Bytes per rank: the training state (16 bytes a parameter, as ZeRO counts it) and one block gathered."""
    p, r, block = counts["parameters"], counts["tp_replicated"], counts["largest_block"]
    state = {"fsdp": 16 * p // n, "zero2": 16 * p // n + 4 * p, "tp": 16 * (p - r) // n + 16 * r,
             "fsdp2": 16 * p // n, "pipeline": 16 * p // n}
    return {s: {"state_bytes": b, "with_block_bytes": b + 8 * block} for s, b in state.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="450m")
    parser.add_argument("--pipeline", action="store_true", help="also dpar.pipeline, 4 stages, born on meta")
    parser.add_argument("--cases", help="comma-separated strategy:way, e.g. fsdp:dcp,fsdp2:dcp (default: all)")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="leave malloc's dynamic mmap threshold on (see [Note: resident memory is not live tensors])")
    parser.add_argument("--reuse", action="store_true", help="reuse the checkpoints already in --workdir")
    parser.add_argument("--max-total-gib", type=float, default=14.0,
                        help="skip a case whose expected resident memory, all ranks together, is over this")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, help="JSON file (default benchmarks/results/born_sharded_memory[_SIZE].json)")
    args = parser.parse_args()

    cases = [(s, w) for s in (*DPAR, "fsdp2") for w in WAYS]
    if args.pipeline:
        cases.append(("pipeline", "dcp"))
    if args.cases:
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]  # type: ignore[misc]
    if not args.glibc_defaults:  # read by glibc as each rank's process starts (spawned ranks inherit it)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="born_sharded_memory_"))
    dcp_dir, st_dir = str(workdir / "dcp"), str(workdir / "safetensors")
    counts = _counts(args.size)
    expected = formulas(counts, WORLD_SIZE)
    record: dict[str, Any] = {
        "revision": revision(), "torch": torch.__version__, "world_size": WORLD_SIZE, "backend": "gloo (CPU)",
        "model": f"HF LlamaForCausalLM {SIZES[args.size]}, fp32, AdamW, {ROWS} x {SEQ} tokens per rank, {STEPS} steps",
        "counts": counts, "replicated_state_bytes": 16 * counts["parameters"],
        "method": "ru_maxrss of each rank (fresh processes per case) minus its VmRSS after imports and process group",
        "malloc": "glibc defaults" if args.glibc_defaults else f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}",
        "cases": {},
    }
    try:
        started = time.perf_counter()
        if args.reuse and os.path.isdir(st_dir):
            print(f"setup: reusing the checkpoints in {workdir}", flush=True)
        else:
            setup = run_ranks(_setup, WORLD_SIZE, args.size, dcp_dir, st_dir, timeout_s=args.timeout_s)
            record["setup"] = {"peak_bytes_max_over_ranks": max(r["peak_bytes"] for r in setup),
                               "seconds": time.perf_counter() - started}
            print(f"setup: {time.perf_counter() - started:.0f} s, peak "
                  f"{max(r['peak_bytes'] for r in setup) / 2**30:.2f} GiB", flush=True)
        for strategy, way in cases:
            started = time.perf_counter()
            label = f"{strategy} via {way}"
            need = WORLD_SIZE * (expected[strategy]["with_block_bytes"] + OVERHEAD_BYTES)
            if need > args.max_total_gib * 2**30:
                record["cases"][label] = {"skipped": f"expected {need / 2**30:.1f} GiB on {WORLD_SIZE} ranks, over "
                                                     f"--max-total-gib {args.max_total_gib}"}
                print(f"{label}: skipped, {record['cases'][label]['skipped']}", flush=True)
                continue
            try:
                ranks = run_ranks(_case, WORLD_SIZE, args.size, strategy, way, dcp_dir, st_dir, timeout_s=args.timeout_s)
            except Exception as exc:  # one failing case (say the pipeline on meta) does not lose the others
                text = str(exc)
                record["cases"][label] = {"error": text[:3000] + "\n...\n" + text[-1500:]}
                print(f"{label}: FAILED {text[:3000]}\n...\n{text[-800:]}", flush=True)
                continue
            record["cases"][label] = _summary(ranks, expected[strategy], time.perf_counter() - started)
            print(f"{label}: {_line(record['cases'][label])}", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    _check_losses(record)
    out = args.out or RESULTS / f"born_sharded_memory{'' if args.size == '450m' else '_' + args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    _table(record, expected)
    print(f"wrote {out}")


def _summary(ranks: list[dict[str, Any]], expected: dict[str, int], seconds: float) -> dict[str, Any]:
    peaks = [r["phases"][f"step {STEPS}"]["peak_bytes"] for r in ranks]
    deltas = [p - r["phases"]["baseline"]["rss_bytes"] for p, r in zip(peaks, ranks)]
    return {
        "peak_bytes_max": max(peaks), "peak_bytes_min": min(peaks),
        "peak_minus_baseline_max": max(deltas), "peak_minus_baseline_min": min(deltas),
        "baseline_bytes_max": max(r["phases"]["baseline"]["rss_bytes"] for r in ranks),
        "formula_state_bytes": expected["state_bytes"], "formula_with_block_bytes": expected["with_block_bytes"],
        "ratio_to_formula_with_block": max(deltas) / expected["with_block_bytes"],
        "step1_losses": [r["losses"][0] for r in ranks], "losses": [r["losses"] for r in ranks],
        "step_seconds": [r["seconds"] for r in ranks], "seconds": seconds,
        "phases": [r["phases"] for r in ranks],
    }


def _line(case: dict[str, Any]) -> str:
    gib = 2**30
    return (f"peak {case['peak_bytes_max'] / gib:.2f} GiB (min {case['peak_bytes_min'] / gib:.2f}), "
            f"minus baseline {case['peak_minus_baseline_max'] / gib:.2f} GiB, formula+block "
            f"{case['formula_with_block_bytes'] / gib:.2f} GiB ({case['ratio_to_formula_with_block']:.2f}x), "
            f"step-1 losses {[round(x, 6) for x in case['step1_losses']]}, {case['seconds']:.0f} s")


def _check_losses(record: dict[str, Any]) -> None:
    """Every case loaded the same weights: each rank's step-1 loss (its own batch) agrees across the cases, and the
    pipeline's (every rank returns the mean over the pipeline group's rows, here all of them) is their mean."""
    ok = {k: c for k, c in record["cases"].items() if "step1_losses" in c and not k.startswith("pipeline")}
    if not ok:
        return
    reference = next(iter(ok.values()))["step1_losses"]
    worst = {k: max(abs(a - b) for a, b in zip(c["step1_losses"], reference)) for k, c in ok.items()}
    mean = sum(reference) / len(reference)
    worst |= {k: max(abs(a - mean) for a in c["step1_losses"]) for k, c in record["cases"].items()
              if k.startswith("pipeline") and "step1_losses" in c}
    record["step1_loss_max_abs_diff"] = worst
    print(f"step-1 loss, each rank against {next(iter(ok))}: max |diff| {max(worst.values()):.2e}")
    if max(worst.values()) > 1e-4:
        print(f"WARNING: the cases did not start from the same weights: {worst}")


def _table(record: dict[str, Any], expected: dict[str, dict[str, int]]) -> None:
    gib = 2**30
    fsdp2 = {w: record["cases"].get(f"fsdp2 via {w}", {}).get("peak_minus_baseline_max") for w in WAYS}
    print(f"P = {record['counts']['parameters'] / 1e6:.1f}M, replicated training state 16P = "
          f"{record['replicated_state_bytes'] / gib:.2f} GiB, {WORLD_SIZE} ranks")
    print("| strategy | weights from | peak RSS/rank GiB (max, min) | minus baseline GiB | formula + block GiB "
          "| / formula+block | / FSDP2 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, c in record["cases"].items():
        strategy, way = label.split(" via ")
        if "error" in c or "skipped" in c:
            print(f"| {strategy} | {way} | {'failed' if 'error' in c else 'skipped'} | | | | |")
            continue
        anchor = fsdp2.get(way) or fsdp2.get("dcp")
        versus = f"{c['peak_minus_baseline_max'] / anchor:.2f}" if anchor else ""
        print(f"| {strategy} | {way} | {c['peak_bytes_max'] / gib:.2f} ({c['peak_bytes_min'] / gib:.2f}) "
              f"| {c['peak_minus_baseline_max'] / gib:.2f} | {c['formula_with_block_bytes'] / gib:.2f} "
              f"| {c['ratio_to_formula_with_block']:.2f} | {versus} |")


if __name__ == "__main__":
    main()
