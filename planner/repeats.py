"""Collapse repeated blocks so the ILP's size does not grow with depth.

[Note: repeated blocks share variables, with period 2]
Ops are grouped into instances by the outermost numbered module in their path
(``blocks.3.attn.q`` belongs to instance ``blocks.3``). Consecutive instances with the same
signature (op kinds, shapes, relative parameter names, which op feeds which, who needs a
gradient) form a run. Instance ``r`` of a run is represented by instance ``r mod 2`` of the
run: two representatives, not one, so that a stack of single-Linear layers can still
alternate column and row (a transformer block, which alternates inside itself, ends up
with both representatives choosing alike). A representative op's cost counts ``count``
times; the edges between consecutive instances become edges between the two
representatives, also counted. With shared choices the collapsed cost is exact.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch.nn as nn

from dpar.planner.opgraph import Edge, Op, OpGraph, ParamInfo

PERIOD = 2


def instance_of(module: str) -> tuple[str, int] | None:
    """``blocks.3.attn.q`` -> (``blocks``, 3): the outermost numbered module."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def _relative(name: str, instance: str) -> str:
    return name[len(instance):] if name == instance or name.startswith(instance + ".") else name


def _signature(ops: list[Op], members: list[int], instance: str) -> tuple:
    local = {index: j for j, index in enumerate(members)}
    return tuple(
        (
            op.kind, _relative(op.module, instance), op.output_shape, op.input_shapes, op.param_shapes,
            tuple(_relative(p, instance) for p in op.params), op.param_grad, op.input_grad, op.input_batched,
            tuple(local.get(i, -1) for i in op.inputs),
        )
        for op in (ops[m] for m in members)
    )


def representatives(ops: list[Op]) -> list[int]:
    """For every op, the op that stands for it (itself unless it sits in a repeated block)."""
    instances: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, op in enumerate(ops):
        key = instance_of(op.module)
        if key is not None:
            instances[key[0]][key[1]].append(i)
    rep = list(range(len(ops)))
    for prefix, by_index in instances.items():
        order = sorted(by_index)
        sigs = {k: _signature(ops, by_index[k], f"{prefix}.{k}" if prefix else str(k)) for k in order}
        runs: list[list[int]] = []
        for k in order:
            if runs and sigs[k] == sigs[runs[-1][0]]:
                runs[-1].append(k)
            else:
                runs.append([k])
        for run in runs:
            for r, member in enumerate(run):
                for a, b in zip(by_index[member], by_index[run[r % PERIOD]]):
                    rep[a] = b
    return rep


def collapse_repeats(
    ops: list[Op], named_params: list[tuple[str, nn.Parameter]], batch_size: int, batch_bytes: int
) -> OpGraph:
    rep = representatives(ops)
    kept = [i for i in range(len(ops)) if rep[i] == i]
    new = {old: j for j, old in enumerate(kept)}
    counts: dict[int, int] = defaultdict(int)
    for i in range(len(ops)):
        counts[new[rep[i]]] += 1
    edge_counts: dict[tuple[int, int, int], int] = defaultdict(int)
    edge_numel: dict[tuple[int, int, int], int] = {}
    for v, op in enumerate(ops):
        for position, u in enumerate(op.inputs):
            if u >= 0:
                key = (new[rep[u]], new[rep[v]], position)
                edge_counts[key] += 1
                edge_numel[key] = math.prod(op.input_shapes[position])
    readers: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, op in enumerate(ops):
        for slot, name in enumerate(op.params):
            readers[name].append((i, slot))
    params, shared = [], set()
    for name, param in named_params:
        found = readers.get(name, [])
        if found:
            (first, slot), others = found[0], found[1:]
            block = instance_of(ops[first].module)
            bucket = f"{block[0]}.{block[1]}" if block else "root"
            params.append(ParamInfo(name, tuple(param.shape), param.requires_grad, new[rep[first]], slot, bucket, param.element_size()))
            shared.update(
                (new[rep[first]], slot, new[rep[j]], s) for j, s in others if new[rep[j]] != new[rep[first]]
            )
        else:
            params.append(ParamInfo(name, tuple(param.shape), param.requires_grad, None, None, None, param.element_size()))
    reps = []
    for old in kept:
        op = ops[old]
        reps.append(
            Op(**{**op.__dict__, "inputs": tuple(new[rep[u]] if u >= 0 else -1 for u in op.inputs), "count": counts[new[old]]})
        )
    edges = tuple(Edge(s, d, p, edge_numel[(s, d, p)], c) for (s, d, p), c in sorted(edge_counts.items()))
    return OpGraph(tuple(reps), edges, tuple(params), tuple(sorted(shared)), batch_size, batch_bytes, len(ops))
