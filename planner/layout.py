"""The model-wide choices: the role of each mesh dimension and what data parallel does to parameters.

The runtime applies one role per mesh dimension to the whole model: ``dp`` (every op
batch-sharded, parameters replicated or sharded by ``data_parallel``), ``tp`` (each op
picks column / row / replicate) or ``ep`` (a data axis too, along which each routed
experts module keeps E / ep of its experts and exchanges tokens: runtime/expert_parallel.py).
At most one dimension is ``tp``; several ``dp`` dimensions act as one data-parallel group
of their product. An ``ep`` dimension is the last one, with at most one ``dp`` dimension
before it and no ``tp`` (the runtime's "ep", "ddp+ep", "zero2+ep", "fsdp+ep"): under a
sharded mode the experts' blocks are sharded over ``dp``, every other parameter over both.
A ``tp`` dimension comes with and without sequence parallel (Megatron-SP: the norms, residuals and
other token-wise ops between tp layers computed on 1/tp of the tokens, their activations held so).
A ``cp`` dimension (context parallel) splits every sequence: the tokens of each row, not the rows,
so the ranks along it share rows; the parameters stay whole over it (sharded over ``dp`` only) and
their gradients are reduced over it too. It comes after at most one ``dp`` ("cp",
"ddp+cp", "zero2+cp", "fsdp+cp"), for a model with attention whose sequence two chunks per rank divide,
and is the last but for a ``tp`` dimension after it ("cp+tp", "<dp strategy>+cp+tp", without sequence parallel,
which would split the sequence too).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from dpar.core.plan import DataParallel, Strategy

# The data-parallel modes the planner prices, by the name its plans keep, in preference order when costs tie.
MODES = {"replicate": DataParallel.DDP, "zero2": DataParallel.ZERO2, "fsdp": DataParallel.FSDP}
DATA_PARALLEL = tuple(MODES)
ROLES = ("dp", "tp", "ep", "cp")


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh_shape: tuple[int, ...]
    roles: tuple[str, ...]
    data_parallel: str
    sequence_parallel: bool = False  # Megatron-SP on the tp axis: the token stream between tp layers split over it

    def axis(self, role: str) -> int | None:
        """The mesh dimension of the one axis of ``role`` (tp, ep or cp); None where there is none."""
        return self.roles.index(role) if role in self.roles else None

    def degree(self, role: str) -> int:
        """That axis's size; 1 where there is none."""
        axis = self.axis(role)
        return 1 if axis is None else self.mesh_shape[axis]

    @property
    def dp_axes(self) -> tuple[int, ...]:
        """The axes that split the batch and reduce the gradients of every parameter outside the experts."""
        return tuple(i for i, r in enumerate(self.roles) if r in ("dp", "ep"))

    @property
    def expert_dp_axes(self) -> tuple[int, ...]:
        """The axes the experts' gradients are reduced over (and their blocks sharded over): the ``dp`` ones."""
        return tuple(i for i, r in enumerate(self.roles) if r == "dp")

    @property
    def ep_axis(self) -> int | None:
        return self.axis("ep")

    @property
    def ep_degree(self) -> int:
        return self.degree("ep")

    @property
    def expert_dp_degree(self) -> int:
        return math.prod(self.mesh_shape[i] for i in self.expert_dp_axes)

    @property
    def cp_axis(self) -> int | None:
        return self.axis("cp")

    @property
    def cp_degree(self) -> int:
        return self.degree("cp")

    @property
    def token_degree(self) -> int:
        """How many ways the global batch's tokens split: rows over the data axes, each sequence over ``cp``."""
        return self.dp_degree * self.cp_degree

    @property
    def tp_axis(self) -> int | None:
        return self.axis("tp")

    @property
    def dp_degree(self) -> int:
        return math.prod(self.mesh_shape[i] for i in self.dp_axes)

    @property
    def tp_degree(self) -> int:
        return self.degree("tp")

    @property
    def dp_placement(self) -> str:
        """A parameter's placement on each data-parallel axis (of size > 1)."""
        return "R" if self.data_parallel == "replicate" else "S(0)"

    @property
    def strategy(self) -> str:
        """``ddp``, ``zero2``, ``fsdp``, ``tp``, ``<dp strategy>+tp``, ``ep``, ``<dp strategy>+ep``, ``cp`` or
        ``<dp strategy>+cp``."""
        for axis in ("ep", "cp"):
            if axis in self.roles:
                activations = "+".join(r for r in self.roles if r != "dp")
                return activations if "dp" not in self.roles else f"{MODES[self.data_parallel].value}+{activations}"
        tensor = self.tp_degree > 1
        return Strategy.compose(None if tensor and self.dp_degree == 1 else MODES[self.data_parallel], tensor).value


def layouts(
    mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...] | None, num_experts: tuple[int, ...] = (),
    sequence_length: int = 0,
) -> list[Layout]:
    """Every role assignment (names fix it) with every data-parallel mode, in tie-break order.

    A dimension of size 1 is ``dp`` unless named: as ``tp``, ``ep`` or ``cp`` it would be the same plan. An ``ep``
    dimension (see the module docstring) only for a model with routed experts (``num_experts``: each experts
    module's count), whose every count its size divides; a ``cp`` one only for a model with attention over
    sequences of ``sequence_length`` tokens (0: none), which two chunks per rank of it divide.
    """
    found = []
    for roles in itertools.product(ROLES, repeat=len(mesh_shape)):
        if roles.count("tp") > 1 or not _expert_roles(roles, mesh_shape, num_experts):
            continue
        if not _context_roles(roles, mesh_shape, sequence_length):
            continue
        if mesh_dim_names is not None and roles != mesh_dim_names:
            continue
        if mesh_dim_names is None and any(r != "dp" and n == 1 for r, n in zip(roles, mesh_shape)):
            continue
        dp_degree = math.prod(n for r, n in zip(roles, mesh_shape) if r == "dp")
        modes = DATA_PARALLEL if dp_degree > 1 else DATA_PARALLEL[:1]
        alone = "dp" not in roles and ("ep" in roles or "cp" in roles)  # no dp axis: ddp's handling of the rest
        tensor = "tp" in roles and mesh_shape[roles.index("tp")] > 1
        sequence = (False, True) if tensor and "cp" not in roles else (False,)
        for mode in DATA_PARALLEL[:1] if alone else modes:
            found += [Layout(tuple(mesh_shape), roles, mode, sp) for sp in sequence]
    return found


# The meshes the runtime takes a cp axis on: each context-parallel strategy's.
_CONTEXT_MESHES = frozenset(s.mesh_dim_names for s in Strategy if s.context_parallel)


def _context_roles(roles: tuple[str, ...], mesh_shape: tuple[int, ...], sequence_length: int) -> bool:
    """Whether ``roles`` places a cp axis as the runtime takes one: none, or ("cp",) / ("dp", "cp"), with a "tp"
    after it or not, over a degree whose two chunks per rank divide the sequence."""
    if "cp" not in roles:
        return True
    return roles in _CONTEXT_MESHES and sequence_length > 0 and sequence_length % (2 * mesh_shape[roles.index("cp")]) == 0


def _expert_roles(roles: tuple[str, ...], mesh_shape: tuple[int, ...], num_experts: tuple[int, ...]) -> bool:
    """Whether ``roles`` places an ep axis as the runtime takes one: none, or the last of ("ep",) / ("dp", "ep")
    over a degree that divides every experts module's count."""
    if "ep" not in roles:
        return True
    return roles in (("ep",), ("dp", "ep")) and bool(num_experts) and all(n % mesh_shape[-1] == 0 for n in num_experts)
