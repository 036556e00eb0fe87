"""Checking a user's promise that every rank of a tensor- or context-parallel group is fed the same rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dpar.core.errors import BatchMismatchError
from dpar.core.torch_internals import resolve_process_group

CHECKED_CALLS = 3
"""How many calls are checked: enough for a sampler bug to show, cheap over a long run."""


def _first_difference(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> str | None:
    for position, tensor in enumerate(tensors):
        # Shapes first: gathering tensors of unequal shapes would fail or hang.
        shapes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(shapes, tuple(tensor.shape), group=group)
        if len(set(shapes)) > 1:
            return f"input {position} has shapes {shapes} across the group"
        parts = [torch.empty_like(tensor) for _ in shapes]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        ranks = dist.get_process_group_ranks(group)
        differ = [ranks[j] for j, part in enumerate(parts) if not torch.equal(part, parts[0])]
        if differ:
            return f"input {position} on ranks {differ} differs from rank {ranks[0]}'s"
    return None


def checking_same_rows(
    compiled: Callable[..., Any], data: Sequence[int], group_name: str, option: str = "same_batch_in_tp_group",
    group: str = "tensor-parallel",
) -> Callable[..., Any]:
    """``compiled`` (called by Dynamo with the graph's inputs) that, for its first calls, checks that
    the inputs at positions ``data`` agree across the group."""
    calls = 0

    def run(*args: Any) -> Any:
        nonlocal calls
        if calls < CHECKED_CALLS:
            calls += 1
            tensors = [args[i] for i in data if isinstance(args[i], torch.Tensor)]
            found = _first_difference(tensors, resolve_process_group(group_name))
            if found is not None:
                raise BatchMismatchError(
                    f"parallelize(..., {option}=True) promised that every rank of a {group} "
                    f"group is fed the same rows, but {found}. Feed the group one batch (shard the data over the "
                    f"data-parallel ranks only), or drop {option} and feed every rank its own slice, "
                    "as with DDP: dpar then moves the rows itself"
                )
        return compiled(*args)

    return run
