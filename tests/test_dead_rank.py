"""A rank killed in the middle of a step: every survivor exits non-zero, soon, with an error that
names the vanished rank and the step (runtime/liveness.py, [Note: a rank that vanishes]).

The ranks are plain processes here, not ``run_ranks``'s, nor torchrun's, whose agent would kill
the survivors itself as soon as one worker dies: what is tested is what a survivor does alone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
STEPS, KILL_AT = 5, 2  # 0-based: killed after the forward of step 3, while the others run its backward
# The bounds of [Note: a rank that vanishes], with room for two busy cores.
ERROR_BOUND_S = 3.0 + 3.0  # a failed collective: LOST_AFTER_S of silence
SILENT_BOUND_S = 3.0 + 10.0 + 4.0  # no failure at all: WATCH_AFTER_S + SILENT_AFTER_S, plus beats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, strategy: str, victim: int, how: int, out: str) -> None:
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    stderr = os.open(f"{out}/stderr.{rank}", os.O_WRONLY | os.O_CREAT)
    os.dup2(stderr, 2)
    torch.set_num_threads(1)
    import torch.distributed as dist

    import dpar
    from gpt import GPT, GPTConfig

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, fused_qkv=False))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    if strategy == "pipeline":
        loss_fn = torch.nn.functional.cross_entropy
        runner = dpar.pipeline(model, lambda logits, t: loss_fn(logits.flatten(0, 1), t.flatten()),
                               example_inputs=(x, y), stages=world_size, micro_batches=2 * world_size)
    elif strategy != "ddp":
        dpar.parallelize(model, strategy=strategy, example_inputs=(x,))
    if strategy != "pipeline":
        runner = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def die_if_victim(step: int) -> None:
        if rank == victim and step == KILL_AT:
            Path(f"{out}/killed").write_text(str(time.time()))
            os.kill(os.getpid(), how)

    try:
        for step in range(STEPS):
            if strategy == "pipeline":
                die_if_victim(step)  # before its step: the others are inside theirs, waiting on it
                runner(x, y)
            else:
                loss = runner(x, y)
                die_if_victim(step)  # after the forward: the others are in the backward
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:
        Path(f"{out}/error.{rank}").write_text(json.dumps({"type": type(exc).__name__, "message": str(exc), "at": time.time()}))
        raise
    dist.destroy_process_group()


def run_with_victim(strategy: str, world_size: int, victim: int, how: int, out: Path, timeout_s: float) -> dict:
    """Exit codes, errors and seconds from the kill to each survivor's error (or exit) by rank."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, strategy, victim, how, str(out))) for r in range(world_size)]
    for p in procs:
        p.start()
    survivors = [r for r in range(world_size) if r != victim]
    deadline = time.monotonic() + timeout_s
    exited_at: dict[int, float] = {}
    try:
        while len(exited_at) < len(survivors) and time.monotonic() < deadline:
            exited_at.update({r: time.time() for r in survivors if r not in exited_at and not procs[r].is_alive()})
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # the stopped victim, or a survivor that hung
            p.join()
    killed = float((out / "killed").read_text())
    outcome = {}
    for r in survivors:
        error = json.loads((out / f"error.{r}").read_text()) if (out / f"error.{r}").exists() else None
        outcome[r] = {
            "exitcode": procs[r].exitcode if r in exited_at else "hung",
            "error": error,
            "stderr": (out / f"stderr.{r}").read_text(),
            "seconds": (error["at"] if error else exited_at.get(r, float("inf"))) - killed,
        }
    return outcome


@pytest.mark.parametrize(
    "strategy,world_size,victim",
    # ddp on 3 ranks: the 2-rank ddp case (its store host killed) names the lost rank the same way.
    [pytest.param("ddp", 3, 1, marks=pytest.mark.extended), ("fsdp", 2, 1),
     pytest.param("tp", 2, 1, marks=pytest.mark.extended), ("ddp", 2, 0), ("pipeline", 2, 1)],
    ids=["ddp-3ranks", "fsdp", "tp", "ddp-store-host-killed", "pipeline"],
)
def test_survivors_of_a_killed_rank_raise_rank_lost_error_naming_it_and_the_step(tmp_path, strategy, world_size, victim):
    import dpar

    outcome = run_with_victim(strategy, world_size, victim, signal.SIGKILL, tmp_path, timeout_s=120)
    for rank, seen in outcome.items():
        assert seen["exitcode"] == 1, (rank, seen)
        assert seen["error"]["type"] == dpar.RankLostError.__name__, seen
        message = seen["error"]["message"]
        if victim == 0:  # it hosted the rendezvous store (init_process_group's env://), which is gone with it
            assert f"rank {rank} lost the rendezvous store in the backward of step {KILL_AT + 1}" in message
            assert "rank 0, is gone" in message
        elif strategy == "pipeline":
            assert f"rank {rank} lost rank(s) [{victim}] in pipeline step {KILL_AT + 1}" in message
            assert f"rank {victim} sent no heartbeat for 3 s (killed or crashed; its last beat: " in message
        else:
            assert f"rank {rank} lost rank(s) [{victim}] in the backward of step {KILL_AT + 1}" in message
            assert f"rank {victim} sent no heartbeat for 3 s (killed or crashed; its last beat: " in message
        assert "torchrun --max-restarts" in message
        assert seen["seconds"] < ERROR_BOUND_S, seen["seconds"]


def test_a_frozen_rank_ends_the_survivors_within_the_silence_bound(tmp_path):
    """SIGSTOP: the socket stays open, as when a host is lost, and gloo alone would wait 30 minutes."""
    outcome = run_with_victim("ddp", 2, 1, signal.SIGSTOP, tmp_path, timeout_s=120)
    seen = outcome[0]
    assert seen["exitcode"] == 1, seen
    assert "dpar.RankLostError: rank 0 lost rank(s) [1] in the backward of step 3" in seen["stderr"]
    assert 10.0 <= seen["seconds"] < SILENT_BOUND_S, seen["seconds"]


def test_import_dpar_sets_nccl_error_handling_unless_the_environment_already_has_it():
    import subprocess

    from dpar.runtime.liveness import NCCL_DEFAULTS

    env = {k: v for k, v in os.environ.items() if k not in NCCL_DEFAULTS} | {"TORCH_NCCL_PROPAGATE_ERROR": "0"}
    shown = subprocess.run(
        [sys.executable, "-c", "import os, dpar; print([os.environ[k] for k in dpar.runtime.liveness.NCCL_DEFAULTS])"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert shown.strip() == "['3', '0', '1']"  # the user's TORCH_NCCL_PROPAGATE_ERROR=0 wins
