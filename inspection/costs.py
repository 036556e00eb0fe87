"""What things cost: the compiler's cost model (``dpar.compiler.costs``), which inspection reads.

It lives in the compiler because ddp's bucket plan is chosen from it; the names stay importable
from here for the simulator, the reports and existing callers.
"""

from dpar.compiler.costs import (
    ALPHA,
    BETA,
    B,
    COMM_TERMS,
    N,
    PRESETS,
    DeviceSpec,
    NodeCost,
    comm_time,
    comm_time_expr,
    device_spec,
    moved_bytes,
    moved_bytes_expr,
    node_cost,
    node_flops,
    payload_bytes,
)

__all__ = [
    "ALPHA", "BETA", "B", "COMM_TERMS", "N", "PRESETS", "DeviceSpec", "NodeCost", "comm_time", "comm_time_expr",
    "device_spec", "moved_bytes", "moved_bytes_expr", "node_cost", "node_flops", "payload_bytes",
]
