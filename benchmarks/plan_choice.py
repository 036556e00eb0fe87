"""Is the planner's choice the fastest when the candidates actually run? Two small models at 4 and 8 gloo ranks.

    python benchmarks/plan_choice.py                        # about 15 minutes on 2 cores
    python benchmarks/plan_choice.py --configs llama-4m@4 --steps 8 --rounds 2

For each config (``model@ranks``) the planner plans the global batch (``rows`` x ``seq`` per rank, every rank
its own rows, 64 tokens a row for the GPT) on a 1-D mesh of the ranks with the ``cpu`` device preset (the cost model of gloo CPU ranks that
``dpar inspect`` uses); then every rank trains the plan as ``parallelize(plan=...)`` applies it (``planned``)
and each named strategy that applies (ddp, zero2, fsdp, tp, and cp for a model with attention), from the same
weights on the same batches, AdamW, aot_eager. After a warm-up the modes take turns (``benchmarks/harness.py``
``turns``), each turn giving every mode a median step; a mode's figure is the median of its turns, its spread
the lowest and highest turn. The planner's choice holds when ``planned`` is the fastest, or within the spread
of the fastest (its slowest turn at least as fast as the planned mode's fastest).

``--pipelines``: a ``pipeline`` mode runs the pipeline search's best pipeline of two stages or more (what
``dpar.plan(..., pipelines=True)`` weighs against the placements; the ``cpu`` preset does not search pipelines by
default) with ``dpar.pipeline`` (the model's logits, a token cross-entropy outside it), taking turns with the
others; the record gives its modelled step beside the planned one, and whether the plan searched with pipelines
(the faster of the two by the model) would have held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

import dpar
from dpar.inspect.pipeline import block_collectives
from dpar.planner.pipeline import SEARCHED_SCHEDULES, PipelineCandidate, layout_of, plan_pipeline
from dpar.planner.plan import PipelineLayout

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from distributed import run_ranks  # noqa: E402
from harness import RESULTS, revision, timed_steps, turns  # noqa: E402
from models import MODELS, batches  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

# The modules trained: the example GPT itself (the sweep's subclass adds a ``blocks`` list for FSDP2, which the
# planner's export would take for a submodule) and Hugging Face Llama.
BUILD = {"gpt-0.8m": lambda: GPT(GPTConfig()), "llama-4m": MODELS["llama-4m"].build}

ROWS, SEQ = 4, 128  # rows a rank, tokens a row (at most the model's context)
NAMED = ("ddp", "zero2", "fsdp", "tp", "cp")


def _plan(model_name: str, world: int) -> dpar.Plan:
    spec = MODELS[model_name]
    torch.manual_seed(0)
    ids, labels = batches(spec, ROWS * world, _seq(model_name), 1, seed=0)[0]
    return dpar.plan(BUILD[model_name](), (ids, labels), mesh_shape=(world,), device="cpu")


def _seq(model_name: str) -> int:
    return min(SEQ, MODELS[model_name].max_seq)


def _applies(strategy: str, model_name: str) -> bool:
    return strategy != "cp" or model_name.startswith("llama")  # cp splits attention's sequences


class Logits(torch.nn.Module):
    """The model's logits, for a pipeline whose loss is taken outside the model (``dpar.pipeline``'s ``loss_fn``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inner = getattr(self.model, "inner", None)
        return self.model(ids) if inner is None else inner(input_ids=ids, use_cache=False).logits


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _best_pipeline(model_name: str, world: int) -> tuple[PipelineCandidate, PipelineLayout]:
    """The pipeline search's fastest pipeline of two stages or more, as dpar.plan's one answer weighs it, and what
    ``dpar.pipeline`` runs for it."""
    spec = MODELS[model_name]
    ids, labels = batches(spec, ROWS * world, _seq(model_name), 1, seed=0)[0]
    model = BUILD[model_name]()
    found = plan_pipeline(model, (ids, labels), world_size=world, memory_budget_gb=None, device="cpu",
                          schedule=SEARCHED_SCHEDULES, min_pp=2, bounded=True,
                          read_tp_collectives=partial(block_collectives, model, pipeline=dpar.pipeline))
    return found.choice, layout_of(found.choice)


def _pipeline_step(model: torch.nn.Module, pipelined: tuple[PipelineCandidate, PipelineLayout],
                   example: tuple[torch.Tensor, ...]):  # noqa: ANN202
    candidate, layout = pipelined
    names, shape = layout.mesh_dims
    mesh = None if names == ("pp",) else init_device_mesh("cpu", shape, mesh_dim_names=names)
    return dpar.pipeline(Logits(model), token_loss, example_inputs=example, mesh=mesh, schedule=layout.schedule,
                         stages=layout.stages, micro_batches=layout.micro_batches, dp_strategy=layout.dp_strategy,
                         activation_checkpointing=candidate.activations)


def measure(rank: int, world: int, model_name: str, plan: dpar.Plan, steps: int, rounds: int, warmup: int,
            pipelined: tuple[PipelineCandidate, PipelineLayout] | None = None) -> dict[str, list[float]] | None:
    """Per mode, its median step (ms) in each turn, on rank 0."""
    spec = MODELS[model_name]
    modes = ["planned", *(s for s in NAMED if _applies(s, model_name)), *(["pipeline"] if pipelined else [])]
    data = batches(spec, ROWS, _seq(model_name), warmup + steps, seed=rank)
    runners = {}
    for mode in modes:
        torch.manual_seed(0)
        model = BUILD[model_name]()
        if mode == "pipeline":
            step = _pipeline_step(model, pipelined, data[0])
            runners[mode] = (step, torch.optim.AdamW(model.parameters(), lr=1e-3))
            continue
        kwargs = {"plan": plan} if mode == "planned" else {"strategy": mode, "example_inputs": data[0]}
        dpar.parallelize(model, **kwargs)
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
        runners[mode] = (compiled, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for mode, (compiled, optimizer) in runners.items():
        timed_steps(compiled, optimizer, data[:warmup])
    per_turn: dict[str, list[float]] = {mode: [] for mode in modes}
    for _, mode, window in turns(modes, rounds, steps, warmup):
        compiled, optimizer = runners[mode]
        step_ms, _ = timed_steps(compiled, optimizer, data[window])
        per_turn[mode].append(statistics.median(step_ms))
    return per_turn if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="gpt-0.8m@4,gpt-0.8m@8,llama-4m@4,llama-4m@8")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_choice.json")
    parser.add_argument("--pipelines", action="store_true", help="also run the pipeline search's best pipeline")
    args = parser.parse_args()
    record = {"revision": revision(), "rows_per_rank": ROWS, "seq": SEQ, "configs": []}
    for config in args.configs.split(","):
        model_name, ranks = config.split("@")
        world = int(ranks)
        plan = _plan(model_name, world)
        pipelined = _best_pipeline(model_name, world) if args.pipelines else None
        per_turn = run_ranks(measure, world, model_name, plan, args.steps, args.rounds, args.warmup, pipelined,
                             timeout_s=1800)[0]
        medians = {mode: statistics.median(t) for mode, t in per_turn.items()}
        fastest = min(medians, key=medians.get)
        holds = fastest == "planned" or max(per_turn[fastest]) >= min(per_turn["planned"])
        entry = {
            "config": config, "planned": plan.strategy + (" (sequence parallel)" if plan.sequence_parallel else ""),
            "modelled_step_ms": plan.cost.step_s * 1e3, "median_ms": medians,
            "turns_ms": per_turn, "fastest": fastest, "planned_vs_fastest": medians["planned"] / medians[fastest],
            "holds": holds,
        }
        if pipelined is not None:  # searched with pipelines, the plan is the faster of the two by the model
            best = pipelined[0]
            answer = "pipeline" if best.step_s < plan.cost.step_s else "planned"
            holds_with = answer == fastest or max(per_turn[fastest]) >= min(per_turn[answer])
            entry["with_pipelines"] = {"pipeline": f"{best.layout}, {best.micro_batches} micro-batches",
                                       "modelled_step_ms": best.step_s * 1e3, "answer": answer, "holds": holds_with}
        record["configs"].append(entry)
        print(f"{config}: planned {entry['planned']}; " + ", ".join(
            f"{m} {medians[m]:.1f} ms [{min(t):.1f}, {max(t):.1f}]" for m, t in per_turn.items())
            + f"; planned / fastest ({fastest}) {entry['planned_vs_fastest']:.2f}: {'holds' if holds else 'does not hold'}",
            flush=True)
        if pipelined is not None:
            found = entry["with_pipelines"]
            print(f"  pipeline: {found['pipeline']}, modelled {found['modelled_step_ms']:.2f} ms (placements "
                  f"{plan.cost.step_s * 1e3:.2f}); searched with pipelines the answer is {found['answer']}: "
                  f"{'holds' if found['holds'] else 'does not hold'}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
