"""The process group dpar communicates on, resolved once per compile."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import torch
import torch.distributed as dist

from dpar.core import torch_internals
from dpar.core.errors import ProcessGroupError
from dpar.core.torch_internals import groups_and_ranks, resolve_process_group, sequence_number


@dataclasses.dataclass(frozen=True)
class World:
    """The ranks a compiled graph communicates with."""

    rank: int
    size: int
    group_name: str
    backend: str


_warned_single_device = False


def _launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def current_world(group: dist.ProcessGroup | None = None) -> World | None:
    """The default (or given) group, or None when training runs on one device.

    A launcher that set WORLD_SIZE > 1 without an initialized process group is a
    mistake we report rather than silently training N independent models.
    """
    global _warned_single_device
    if not dist.is_available() or not dist.is_initialized():
        launched = _launched_world_size()
        if launched > 1:
            raise ProcessGroupError(
                f"WORLD_SIZE={launched} is set (a launcher such as torchrun started this process) "
                "but torch.distributed is not initialized. Call "
                "torch.distributed.init_process_group('gloo' or 'nccl') before the first call of "
                "the compiled model."
            )
        size = 1
    else:
        group = group or dist.group.WORLD
        size = dist.get_world_size(group)
    if size == 1:
        if not _warned_single_device:
            warnings.warn(
                "dpar: no process group with more than one rank; running on one device.",
                stacklevel=3,
            )
            _warned_single_device = True
        return None
    assert group is not None
    return World(
        rank=dist.get_rank(group),
        size=size,
        group_name=group.group_name,
        backend=dist.get_backend(group),
    )


def check_devices(tensors: dict[str, torch.Tensor], world: World) -> torch.device:
    """All parameters share one device, and it is one the backend can reach."""
    first_on: dict[str, str] = {}
    for name, t in tensors.items():
        first_on.setdefault(str(t.device), name)
    if len(first_on) > 1:
        where = ", ".join(f"{name} on {dev}" for dev, name in first_on.items())
        raise ProcessGroupError(
            f"parameters are on different devices ({where}); dpar replicates one device per "
            "rank: move the whole model with model.to(device) before compiling."
        )
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    wanted = {"gloo": "cpu", "nccl": "cuda"}.get(world.backend)
    if wanted is not None and device.type != wanted:
        raise ProcessGroupError(
            f"the process group uses {world.backend}, which needs {wanted} tensors, but the "
            f"parameters are on {device}: move the model to {wanted} or initialize the process "
            f"group with {'nccl' if device.type == 'cuda' else 'gloo'}."
        )
    return device


def world_of_group(group_name: str) -> World:
    """The ranks of the group this process knows as ``group_name`` (a mesh axis's, say)."""
    group = resolve_process_group(group_name)
    return World(rank=dist.get_rank(group), size=dist.get_world_size(group), group_name=group_name,
                 backend=dist.get_backend(group))


def group_size(group_name: str) -> int:
    return dist.get_world_size(resolve_process_group(group_name))


def group_ranks(group_name: str) -> list[int]:
    """The default group's ranks of the members of ``group_name``."""
    return dist.get_process_group_ranks(resolve_process_group(group_name))


def default_store() -> dist.Store:
    """The rendezvous store every rank of the default group reaches."""
    return torch_internals.default_store()


def wait_for_keys(store: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Whether all ``keys`` are in ``store`` within ``timeout_s``.

    Polls rather than ``store.wait``, whose timeouts c10d logs as warnings, and waiting
    ranks time out in turns here by design.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, 0.05)
    return True


def global_rank(world: World, group_rank: int) -> int:
    """The default group's rank of ``world``'s rank ``group_rank``."""
    return dist.get_global_rank(resolve_process_group(world.group_name), group_rank)


def collectives_issued() -> dict[str, int]:
    """How many collectives this process has issued on each group it belongs to (c10d's sequence numbers).

    Keyed by group name and member ranks, which every member of a group spells the
    same, so two ranks' counts compare on the groups they share.
    """
    return {
        f"{pg.group_name}{sorted(ranks)}": sequence_number(pg)
        for pg, ranks in groups_and_ranks().items()
        if isinstance(pg, dist.ProcessGroup)  # c10d keys a group this rank is not in by an int sentinel
    }
