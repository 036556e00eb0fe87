"""Expert parallel: mark the grouped matmuls that run on the exchange's fixed-size buffers, for the cost model.

The experts module computes on the rows an all-to-all handed it, ep times the rows routed to this rank on average
(see [Note: routed tokens in fixed-size buffers] in runtime/expert_parallel.py); a grouped matmul's offsets skip the
empty slots, so its work is that share. Run on the joint graph, so the forward's and the backward's matmuls both keep
the mark (``ROUTED_SHARE`` in ``node.meta``) through the partitioner.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dpar.compiler.costs import ROUTED_SHARE, grouped_mm
from dpar.core.torch_internals import C10D_FUNCTIONAL


def _rows(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() else None


def mark_routed_rows(gm: fx.GraphModule, *, group_name: str, ep_size: int) -> fx.GraphModule:
    """Mark each grouped matmul whose rows are as many as an all-to-all's over the ep group moves."""
    buffers = {_rows(n) for n in gm.graph.nodes
               if n.target is C10D_FUNCTIONAL.all_to_all_single.default and n.args[-1] == group_name}
    for node in gm.graph.nodes:
        packet = getattr(node.target, "_overloadpacket", None)
        if grouped_mm(packet) is not None and isinstance(node.args[0], fx.Node) and _rows(node.args[0]) in buffers:
            node.meta[ROUTED_SHARE] = ep_size
    return gm
