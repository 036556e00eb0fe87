"""Restart and resume: examples/gpt.py killed in the middle of a step (--fail-at-step) and restarted by
torchrun --max-restarts continues from its last checkpoint to the same parameters and optimizer state,
bit for bit, as an uninterrupted run (examples/gpt.py, [Note: resuming exactly]).

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: on torch 2.13 the workers of a restarted attempt otherwise share
the launcher's store with the dead attempt and may read its gloo addresses (connectFullMesh: connection
refused; pytorch/pytorch#135712). --standalone: a free port, not 29500, so runs cannot collide.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY, FAIL_AT = 6, 2, 5  # checkpoints after steps 2, 4, 6; killed in step 5: steps 5 and 6 run again


def train(directory: Path, *extra: str, max_restarts: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", str(max_restarts), str(ROOT / "examples" / "gpt.py"),
        "--steps", str(STEPS), "--batch-size", "2", "--log-every", "1",
        "--resume", str(directory), "--checkpoint-every", str(EVERY), *extra,
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def final_state(directory: Path) -> dict:
    """The last checkpoint (model and AdamW state of both ranks' shares) as one plain state dict."""
    file = directory / "final.pt"
    dcp_to_torch_save(directory / f"step-{STEPS:06d}", file)
    return torch.load(file)


def flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_a_run_killed_mid_step_and_restarted_by_torchrun_ends_bit_for_bit_like_an_uninterrupted_one(tmp_path):
    killed = train(tmp_path / "killed", "--fail-at-step", str(FAIL_AT), max_restarts=1)
    assert f"rank 1: --fail-at-step {FAIL_AT}: SIGKILL" in killed.stdout
    assert f"resumed from {tmp_path / 'killed'}/step-{FAIL_AT - 1:06d}" in killed.stdout
    assert (tmp_path / "killed" / f"failed-at-step-{FAIL_AT}").exists()
    uninterrupted = train(tmp_path / "uninterrupted", max_restarts=0)
    assert "resumed" not in uninterrupted.stdout

    resumed, reference = flat(final_state(tmp_path / "killed")), flat(final_state(tmp_path / "uninterrupted"))
    assert resumed.keys() == reference.keys()
    tensors = [k for k, v in reference.items() if isinstance(v, torch.Tensor)]
    assert len([k for k in tensors if k.startswith("model.")]) > 20  # parameters, and AdamW's moments below
    assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg_sq") for k in tensors)
    different = [k for k in tensors if not torch.equal(resumed[k], reference[k])]
    assert different == [], different
    # The losses logged after the restart are the uninterrupted run's, to the last printed digit.
    losses = lambda run: [l.split()[3] for l in run.stdout.splitlines() if l.startswith("step ") and int(l.split()[1]) >= FAIL_AT]
    assert losses(killed)[-2:] == losses(uninterrupted)[-2:] and len(losses(uninterrupted)) == 2
