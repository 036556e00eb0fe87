"""The model-wide choices: the role of each mesh dimension and what data parallel does to parameters.

The runtime applies one role per mesh dimension to the whole model: ``dp`` (every op
batch-sharded, parameters replicated or sharded by ``data_parallel``) or ``tp`` (each op
picks column / row / replicate). At most one dimension is ``tp``; several ``dp``
dimensions act as one data-parallel group of their product.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from dpar.core.plan import DataParallel, Strategy

# The data-parallel modes the planner prices, by the name its plans keep, in preference order when costs tie.
MODES = {"replicate": DataParallel.DDP, "zero2": DataParallel.ZERO2, "fsdp": DataParallel.FSDP}
DATA_PARALLEL = tuple(MODES)
ROLES = ("dp", "tp")


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh_shape: tuple[int, ...]
    roles: tuple[str, ...]
    data_parallel: str

    @property
    def dp_axes(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.roles) if r == "dp")

    @property
    def tp_axis(self) -> int | None:
        return self.roles.index("tp") if "tp" in self.roles else None

    @property
    def dp_degree(self) -> int:
        return math.prod(self.mesh_shape[i] for i in self.dp_axes)

    @property
    def tp_degree(self) -> int:
        return 1 if self.tp_axis is None else self.mesh_shape[self.tp_axis]

    @property
    def dp_placement(self) -> str:
        """A parameter's placement on each data-parallel axis (of size > 1)."""
        return "R" if self.data_parallel == "replicate" else "S(0)"

    @property
    def strategy(self) -> str:
        """``ddp``, ``zero2``, ``fsdp``, ``tp``, or ``<dp strategy>+tp``."""
        tensor = self.tp_degree > 1
        return Strategy.compose(None if tensor and self.dp_degree == 1 else MODES[self.data_parallel], tensor).value


def layouts(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None) -> list[Layout]:
    """Every role assignment (names fix it) with every data-parallel mode, in tie-break order.

    A dimension of size 1 is ``dp`` unless named: as ``tp`` it would be the same plan.
    """
    found = []
    for roles in itertools.product(ROLES, repeat=len(mesh_shape)):
        if roles.count("tp") > 1:
            continue
        if mesh_dim_names is not None and roles != mesh_dim_names:
            continue
        if mesh_dim_names is None and any(r == "tp" and n == 1 for r, n in zip(roles, mesh_shape)):
            continue
        dp_degree = math.prod(n for r, n in zip(roles, mesh_shape) if r == "dp")
        for mode in DATA_PARALLEL if dp_degree > 1 else DATA_PARALLEL[:1]:
            found.append(Layout(tuple(mesh_shape), roles, mode))
    return found
