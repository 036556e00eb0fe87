"""Sharded parameters while graphs are traced: an uneven ``Shard(0)`` reduce-scattered after one pad.

Parameters are replaced by their shards once, at ``parallelize`` (surgery/sharding.py, where [Note: how a
sharded parameter reaches the graph] is); what is left here runs while the backend traces their graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from dpar.core.torch_internals import pad_tensor, per_chunk_shard_reducer, reduce_scatter_single, set_shard_reducer


# [Note: uneven shards, one pad]
# DTensor's ``Shard(0)`` follows ``torch.chunk``: with d0 rows over N ranks the
# last ranks get fewer rows, or none. To reduce-scatter such a gradient
# (``Shard._reduce_shard_tensor``) DTensor splits the full tensor into N chunks,
# pads each to ``ceil(d0 / N)`` rows and concatenates them: 2N + 1 traced ops per
# parameter, tens of thousands of nodes at the N = 1024 ``dpar inspect`` simulates.
# Padding the whole tensor once at its end gives the same buffer (the chunks are
# consecutive row ranges, and only the last non-empty one and the empty ones are
# short), so the same reduce-scatter and the same shard. dpar's backend traces its
# graphs this way, at 2 ranks as at 1024, so what ``explain`` reports is the
# program that trains. Shards at rest keep DTensor's layout (and so the optimizer
# state and checkpoints theirs).


@contextlib.contextmanager
def uneven_shards_padded_once() -> Iterator[None]:
    """While graphs are traced inside the block, an uneven ``Shard`` is reduce-scattered after one pad."""
    per_chunk = per_chunk_shard_reducer()

    def reduce_shard_tensor(
        self: Shard, tensor: torch.Tensor, mesh: DeviceMesh, reduce_op: str, mesh_dim: int
    ) -> torch.Tensor:
        size, ranks, coordinate = tensor.size(self.dim), mesh.size(mesh_dim), mesh.get_coordinate()
        if size % ranks == 0 or coordinate is None:
            return per_chunk(self, tensor, mesh, reduce_op, mesh_dim)
        chunk = -(-size // ranks)
        padded = pad_tensor(tensor, self.dim, chunk * ranks - size).contiguous()
        shard = reduce_scatter_single(padded, reduce_op, scatter_dim=self.dim, group=(mesh, mesh_dim))
        rows = max(0, min(chunk, size - coordinate[mesh_dim] * chunk))
        return shard if rows == chunk else shard.narrow(self.dim, 0, rows)

    # A monkeypatch: DTensor chooses how a Partial becomes a Shard inside full_tensor's backward, with no public hook.
    set_shard_reducer(reduce_shard_tensor)
    try:
        yield
    finally:
        set_shard_reducer(per_chunk)
