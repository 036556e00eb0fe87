"""One process standing in for N ranks: torch's fake process group."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from dpar.compiler import registry


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake group of ``world_size`` ranks, fresh Dynamo state and an empty graph registry."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    torch._dynamo.reset()
    registry.compiled_graphs.clear()
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
