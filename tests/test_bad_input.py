"""Bad input fails fast with an error that names the problem and the fix."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

import dpar
from distributed import RankFailed, run_ranks
from dpar.core.world import World, check_devices


def compile_and_run(options: dict) -> None:
    torch._dynamo.reset()
    model = torch.compile(nn.Linear(4, 4), backend="dpar", options=options)
    model(torch.randn(2, 4))


def test_unknown_option_names_the_valid_keys() -> None:
    with pytest.raises(ValueError, match=r"unknown dpar option\(s\) \['bucket_size'\]; valid keys are .*'bucket_cap_mb'"):
        compile_and_run({"bucket_size": 25})


@pytest.mark.parametrize("cap", [0, -1, "25", True])
def test_bucket_cap_must_be_a_positive_number(cap) -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB greater than 0"):
        compile_and_run({"bucket_cap_mb": cap})


def test_unknown_inner_compiler() -> None:
    with pytest.raises(ValueError, match=r"compiler must be one of \['inductor', 'aot_eager', 'eager'\]"):
        compile_and_run({"compiler": "tvm"})


def test_launcher_without_process_group_says_to_initialize_it(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(dpar.ProcessGroupError, match="init_process_group"):
        compile_and_run({"compiler": "aot_eager"})


def test_parameters_on_different_devices_are_refused() -> None:
    world = World(rank=0, size=2, group_name="0", backend="gloo")
    params = {"a.weight": torch.zeros(2), "b.weight": torch.zeros(2, device="meta")}
    with pytest.raises(dpar.ProcessGroupError, match=r"different devices \(a.weight on cpu, b.weight on meta\).*model.to"):
        check_devices(params, world)


def test_gloo_with_cuda_parameters_names_the_backend_to_use() -> None:
    world = World(rank=0, size=2, group_name="0", backend="nccl")
    with pytest.raises(dpar.ProcessGroupError, match="nccl, which needs cuda tensors.*initialize the process group with gloo"):
        check_devices({"w": torch.zeros(2)}, world)


def _shapes_differ(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8 + rank), nn.Linear(8 + rank, 2))
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "check_timeout_s": 30})
    compiled(torch.randn(2, 8)).sum().backward()


def test_parameter_shapes_that_differ_across_ranks_are_named() -> None:
    with pytest.raises(RankFailed) as failure:
        run_ranks(_shapes_differ, 2, timeout_s=120)
    message = str(failure.value)
    assert "CollectiveMismatchError" in message
    assert "parameter and buffer shapes differ between ranks" in message
    assert "parameter 0.weight float32[8, 8]" in message and "parameter 0.weight float32[9, 8]" in message


def _graph_differs(rank: int, world_size: int) -> None:
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            y = self.b(x)
            # Same parameters in the graph on both ranks, but b gets no gradient on rank 1.
            return y if rank == 0 else y.detach() + x

    compiled = torch.compile(Model(), backend="dpar", options={"compiler": "aot_eager", "check_timeout_s": 30})
    compiled(torch.randn(2, 8)).sum().backward()


def test_collective_sequence_mismatch_fails_within_seconds_instead_of_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_ranks(_graph_differs, 2, timeout_s=120)
    elapsed = time.monotonic() - start
    message = str(failure.value)
    assert "CollectiveMismatchError: collective sequences differ between ranks" in message
    assert "first difference at #0" in message
    assert "all_reduce float32[144] over 2 ranks" in message and "all_reduce float32[72] over 2 ranks" in message
    assert elapsed < 60
