"""One pad per uneven reduce-scatter while ``explain`` traces, instead of one per rank.

[Note: uneven shards at large simulated N]
DTensor's ``Shard(0)`` follows ``torch.chunk``: with d0 rows over N ranks the
last ranks get fewer rows, or none. To reduce-scatter such a gradient DTensor
(``Shard._reduce_shard_tensor``) splits the full tensor into N chunks, pads
each to ``ceil(d0 / N)`` rows and concatenates them: 2N + 1 traced ops per
parameter. At N = 1024 that is most of ``dpar inspect``'s time (about 70% of
the ~95 s GPT example) and tens of thousands of graph nodes. Padding the whole
tensor once at its end gives the same buffer (the chunks are consecutive row
ranges, and only the last non-empty one and the empty ones are short), the
same reduce-scatter and the same shard, so the graphs keep every collective,
their sizes and their order; only the pad prologue is shorter.
The runtime (``runtime/sharding.py``) still takes DTensor's path; when it pads
once (or keeps shards evenly padded, as FSDP2 does), this goes away.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor._collective_utils import pad_tensor


@contextlib.contextmanager
def padded_once() -> Iterator[None]:
    """Within the block, DTensor reduce-scatters an uneven ``Shard`` after a single pad."""
    per_chunk = Shard._reduce_shard_tensor

    def reduce_shard_tensor(
        self: Shard, tensor: torch.Tensor, mesh: DeviceMesh, reduce_op: str, mesh_dim: int
    ) -> torch.Tensor:
        size, ranks, coordinate = tensor.size(self.dim), mesh.size(mesh_dim), mesh.get_coordinate()
        if size % ranks == 0 or coordinate is None:
            return per_chunk(self, tensor, mesh, reduce_op, mesh_dim)
        chunk = -(-size // ranks)
        padded = pad_tensor(tensor, self.dim, chunk * ranks - size).contiguous()
        shard = funcol.reduce_scatter_single(padded, reduce_op, scatter_dim=self.dim, group=(mesh, mesh_dim))
        rows = max(0, min(chunk, size - coordinate[mesh_dim] * chunk))
        return shard if rows == chunk else shard.narrow(self.dim, 0, rows)

    Shard._reduce_shard_tensor = reduce_shard_tensor
    try:
        yield
    finally:
        Shard._reduce_shard_tensor = per_chunk
