"""Starting every replica from rank 0's parameters and buffers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from dpar.core.torch_internals import resolve_process_group
from dpar.runtime.agreement import agree
from dpar.core.world import World

# Marks a tensor whose values came from rank 0. A mark on the tensor, not a table keyed by it: swap_tensors
# (to_empty) refuses a tensor any weak reference points at. Its values are the tensor's own, so the mark
# leaves with them: swap_tensors moves it to the tensor swapped out, and load_state_dict(assign=True)'s new
# tensor has none, so a graph compiled over such new values broadcasts them, as before.
_SYNCHRONIZED = "_dpar_synchronized"


def synchronize_replicas(
    state: Sequence[tuple[str, str, torch.Tensor]], world: World, timeout_s: float, *, broadcast: bool = True
) -> int:
    """Check that every rank holds the same (kind, name, shape, dtype) state, then broadcast
    from rank 0 the tensors not broadcast before. Returns how many tensors were sent.

    ``state`` holds (kind, qualified name, tensor) triples in graph-input order. A graph
    whose state was all synchronized before (an evaluation or no_grad recompile of a
    model already trained) returns at once: it may be compiled on some ranks only, and
    they would wait here for ranks that never come. Only a graph that reads a tensor for
    the first time rendezvouses, so every rank must compile that one. ``broadcast=False``
    checks without sending: replicas that differ by design (local SGD resumed mid-period).
    """
    fresh = [t for _, _, t in state if not getattr(t, _SYNCHRONIZED, False)]
    if world.backend == "fake" or not fresh:  # fake: simulated ranks, nothing to agree with or send to
        return 0
    agree(
        world,
        "parameters and buffers of a newly compiled graph",
        [f"{kind} {name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for kind, name, t in state],
        timeout_s,
        subject="parameter and buffer shapes",
    )
    group = resolve_process_group(world.group_name)
    with torch.no_grad():
        for tensor in fresh:
            if broadcast:
                dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
            setattr(tensor, _SYNCHRONIZED, True)
    return len(fresh) if broadcast else 0
