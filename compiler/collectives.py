"""Reading the collectives a graph holds: the shared view for checks, tests and reports."""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from dpar.core.torch_internals import C10D_FUNCTIONAL

c10d = C10D_FUNCTIONAL

COLLECTIVE_KINDS: dict[object, str] = {
    c10d.all_reduce.default: "all_reduce",
    c10d.broadcast.default: "broadcast",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",  # tensor parallel moving a shard to another dim
}
WAIT = c10d.wait_tensor.default


def is_communication(node: fx.Node) -> bool:
    """Any functional-collective op: the kinds above, their waits, and ones dpar never inserts (coalesced
    variants a model's own code may call), by the op's namespace, so nothing a rank sends is missed."""
    return getattr(node.target, "namespace", None) in ("_c10d_functional", "c10d_functional")

# Ops that only reinterpret memory: they are not compute a collective can hide behind.
_NON_COMPUTE = {
    operator.getitem,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.t.default,
    torch.ops.aten.split_with_sizes.default,
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective in a graph, from its issue to its wait."""

    kind: str
    group: str
    dtype: torch.dtype
    shape: tuple[str, ...]
    bytes: int
    issue_node: str
    wait_node: str
    compute_between: int

    def fingerprint(self, group: str | None = None, *, shape: bool = True) -> str:
        """One line per collective; ``group`` replaces the group name where names are per rank; ``shape=False``
        leaves the shape out (for ranks that share no group: [Note: what only a sub-group agrees on])."""
        where = group if group is not None else f"group={self.group}"
        dims = f"[{', '.join(self.shape)}]" if shape else ""
        return f"{self.kind} {str(self.dtype).removeprefix('torch.')}{dims} {where}"


def _group_arg(node: fx.Node) -> str:
    return str(node.args[-1])


def _numel_bytes(val: torch.Tensor) -> int:
    try:
        return int(val.numel()) * val.element_size()
    except (TypeError, RuntimeError):  # symbolic numel
        return -1


def runs_an_op(node: fx.Node) -> bool:
    """A node that calls a device op, views included (each costs a dispatch): not Python's ``getitem``, not a
    collective or a wait."""
    return (
        node.op == "call_function"
        and node.target not in COLLECTIVE_KINDS
        and node.target is not WAIT
        and node.target is not operator.getitem
    )


def is_compute(node: fx.Node) -> bool:
    return runs_an_op(node) and node.target not in _NON_COMPUTE


def collectives(gm: fx.GraphModule) -> list[Collective]:
    """The collectives in issue order, each matched to its wait_tensor."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    found = []
    for node in nodes:
        kind = COLLECTIVE_KINDS.get(node.target)
        if kind is None:
            continue
        waits = [u for u in node.users if u.target is WAIT]
        wait = waits[0] if waits else None
        end = position[wait] if wait is not None else len(nodes)
        between = sum(1 for n in nodes[position[node] + 1 : end] if is_compute(n))
        val = node.args[0].meta.get("val")
        found.append(
            Collective(
                kind=kind,
                group=_group_arg(node),
                dtype=val.dtype if val is not None else torch.float32,
                shape=tuple(str(s) for s in val.shape) if val is not None else ("?",),
                bytes=_numel_bytes(val) if val is not None else -1,
                issue_node=node.name,
                wait_node=wait.name if wait is not None else "",
                compute_between=between,
            )
        )
    return found


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    """Collective and wait counts, for before/after diffs of a pass."""
    counts = {kind: 0 for kind in COLLECTIVE_KINDS.values()}
    counts["wait_tensor"] = 0
    for node in gm.graph.nodes:
        if node.target in COLLECTIVE_KINDS:
            counts[COLLECTIVE_KINDS[node.target]] += 1
        elif node.target is WAIT:
            counts["wait_tensor"] += 1
    return counts
