"""N simulated ranks in one process: torch's fake process group, set up and torn down."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist

from dpar.core.errors import OptionsError, ProcessGroupError
from dpar.core.torch_internals import register_fake_backend


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Rank ``rank`` of a fake group of ``world_size``: collectives return at once and move nothing.

    Refuses to run beside a real process group: the default group is global, and
    replacing a training job's group would break it.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise OptionsError(f"world_size must be a positive int, got {world_size!r}")
    if dist.is_initialized():
        raise ProcessGroupError(
            f"dpar.explain simulates ranks with a fake process group, but a "
            f"{dist.get_backend()!r} process group is already initialized. Call explain before "
            "init_process_group, after destroy_process_group, or in a separate process "
            "(`dpar inspect` runs in its own)."
        )
    launched = os.environ.pop("WORLD_SIZE", None)  # a launcher's WORLD_SIZE is not ours to simulate
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if launched is not None:
            os.environ["WORLD_SIZE"] = launched
