"""One process standing in for N ranks: torch's fake process group."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from dpar.compiler import registry


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[list[registry.CompiledGraph]]:
    """A fake group of ``world_size`` ranks and fresh Dynamo state; yields the graphs dpar compiles inside."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    torch._dynamo.reset()
    try:
        with registry.recording() as graphs:
            yield graphs
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
