"""The machine the planner prices a plan on: one rank's roofline and one α-β link per mesh dimension."""

from __future__ import annotations

import dataclasses

from dpar.core.errors import OptionsError

GPUS_PER_NODE = 8
"""A mesh dimension of at most this many ranks is taken to stay inside one node (NVLink)."""

# H100 SXM: dense BF16 989 TFLOP/s, HBM3 3.35 TB/s; NVLink 4 450 GB/s per direction,
# one 400 Gb/s (50 GB/s) NIC per GPU across nodes. α: NCCL's per-step latency, roughly.
H100_PEAK_FLOPS = 989e12
H100_MEM_BANDWIDTH = 3.35e12
INTRA_NODE = (1e-6, 1 / 450e9)  # (alpha s, beta s/byte)
INTER_NODE = (5e-6, 1 / 50e9)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-rank peak compute and memory bandwidth, and each mesh dimension's ring latency and bandwidth.

    ``alpha[i]`` is the seconds per ring step and ``beta[i]`` the seconds per byte of one
    rank's link along mesh dimension ``i``: a slow (inter-node) and a fast (intra-node)
    dimension are priced differently, which is what lets the planner put data parallel on
    the slow one and tensor parallel on the fast one.
    """

    peak_flops: float
    mem_bandwidth: float
    alpha: tuple[float, ...]
    beta: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.alpha) != len(self.beta):
            raise OptionsError(f"Hardware: alpha has {len(self.alpha)} entries but beta {len(self.beta)}; give one per mesh dimension")

    def check_mesh(self, mesh_shape: tuple[int, ...]) -> None:
        if len(self.alpha) != len(mesh_shape):
            raise OptionsError(
                f"Hardware has alpha/beta for {len(self.alpha)} mesh dimension(s) but mesh_shape {mesh_shape} has "
                f"{len(mesh_shape)}; give one (alpha, beta) per mesh dimension, or pass hardware=None for the H100 default"
            )


def h100(mesh_shape: tuple[int, ...]) -> Hardware:
    """H100 nodes of 8: the last mesh dimension is intra-node when it fits in a node, the others inter-node."""
    links = [INTER_NODE] * len(mesh_shape)
    if mesh_shape and mesh_shape[-1] <= GPUS_PER_NODE:
        links[-1] = INTRA_NODE
    return Hardware(H100_PEAK_FLOPS, H100_MEM_BANDWIDTH, tuple(a for a, _ in links), tuple(b for _, b in links))

