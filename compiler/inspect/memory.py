"""Per-rank memory: parameters, gradients, optimizer state, and an activation peak estimate."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import sympy
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from dpar.compiler.collectives import WAIT
from dpar.compiler.inspect.costs import N
from dpar.compiler.inspect.strategies import Strategy

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0, "none": 0}
"""Tensors of a parameter's size (and dtype) each optimizer keeps per parameter."""

P, G, S, A = sympy.symbols("P G S A", nonnegative=True)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at the peak of a step."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int  # peak of live intermediate tensors over forward + backward (estimate)
    formula: sympy.Expr  # total bytes as a function of N (P, G, S, A substituted)
    symbolic: sympy.Expr  # the same in P, G, S, A and N

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def total_at(self, world_size: int) -> int:
        return int(self.formula.subs(N, world_size))


Storage = tuple[object, int]  # (identity, bytes)


def _storages(node: fx.Node) -> list[Storage]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [
        (StorageWeakRef(v.untyped_storage()), int(v.untyped_storage().nbytes()))
        for v in vals
        if isinstance(v, torch.Tensor)
    ]


@dataclasses.dataclass(frozen=True)
class _Liveness:
    peak: int
    live_at_end: int
    counted: dict[object, int]  # storage -> bytes counted as activation (0: parameter or input)


def _liveness(gm: fx.GraphModule, same_as: dict[object, object], counted_inputs: set[str], exclude_outputs: bool) -> _Liveness:
    """Bytes of storages alive over ``gm``'s nodes, a storage dying after its last reader.

    Placeholders count only if named in ``counted_inputs``; other placeholders (and
    views of them) are parameters or user data. ``same_as`` renames storages so
    that a backward input is the forward storage it was saved from. A storage the
    graph returns stays alive to the end, or (``exclude_outputs``, for the gradients
    a backward returns) is not counted at all.
    """
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = i

    same_as = dict(same_as)
    for node in nodes:  # a wait returns the collective's own buffer (fake tensors give it a new one)
        if node.target is WAIT:
            for (key, _), (arg_key, _) in zip(_storages(node), _storages(node.args[0])):
                same_as[key] = same_as.get(arg_key, arg_key)

    def storages(node: fx.Node) -> list[Storage]:
        return [(same_as.get(key, key), nbytes) for key, nbytes in _storages(node)]

    kept = {key for n in gm.graph.output_node().all_input_nodes for key, _ in storages(n)}
    counted: dict[object, int] = {}
    alive_until: dict[object, int] = {}
    live = peak = 0
    for i, node in enumerate(nodes):
        skip = node.op == "placeholder" and node.name not in counted_inputs
        for key, nbytes in storages(node):
            if key not in counted:
                counted[key] = 0 if skip or (exclude_outputs and key in kept) else nbytes
                live += counted[key]
            if counted[key]:
                end = len(nodes) if key in kept else last_use.get(node, i)
                alive_until[key] = max(alive_until.get(key, i), end)
        peak = max(peak, live)
        for key in [k for k, end in alive_until.items() if end == i]:
            live -= counted[key]
            del alive_until[key]
    return _Liveness(peak, live, counted)


def _saved_inputs(forward: fx.GraphModule, fw: _Liveness, backward: fx.GraphModule) -> tuple[dict[object, object], set[str]]:
    """Which backward inputs are activations saved by ``forward``, under the forward's storage names."""
    forward_nodes = {n.name: n for n in forward.graph.nodes}
    same_as: dict[object, object] = {}
    counted: set[str] = set()
    for node in backward.graph.nodes:
        if node.op != "placeholder":
            continue
        source = forward_nodes.get(node.name)
        if source is None:  # tangents: made by the caller of backward
            counted.add(node.name)
            continue
        for (key, _), (fw_key, _) in zip(_storages(node), _storages(source)):
            same_as[key] = fw_key
        if source.op != "placeholder" and any(fw.counted.get(k) for k, _ in _storages(source)):
            counted.add(node.name)
    return same_as, counted


def activation_peak(pairs: Sequence[tuple[fx.GraphModule, fx.GraphModule | None]]) -> int:
    """Peak activation bytes over the forward graphs in order, then the backward graphs in reverse.

    What a forward graph returns (saved activations, outputs) stays live until
    its backward; parameters, user inputs and views of them are not activations.
    """
    peak = saved = 0
    forwards = []
    for forward, _ in pairs:
        fw = _liveness(forward, {}, set(), exclude_outputs=False)
        peak = max(peak, saved + fw.peak)
        saved += fw.live_at_end
        forwards.append(fw)
    for (forward, backward), fw in reversed(list(zip(pairs, forwards))):
        saved -= fw.live_at_end
        if backward is None:
            continue
        same_as, counted = _saved_inputs(forward, fw, backward)
        bw = _liveness(backward, same_as, counted, exclude_outputs=True)
        peak = max(peak, saved + bw.peak)
    return peak


def per_rank_memory(
    parameters: Sequence[torch.nn.Parameter],
    strategy: Strategy,
    optimizer: str,
    activations: int,
    world_size: int,
) -> Memory:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)}")
    param_bytes = sum(p.numel() * p.element_size() for p in parameters)
    grad_bytes = sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)
    state_bytes = OPTIMIZER_STATES[optimizer] * grad_bytes
    symbolic = strategy.parameters * P + strategy.gradients * G + strategy.optimizer * S + A
    formula = symbolic.subs({P: param_bytes, G: grad_bytes, S: state_bytes, A: activations})

    def at_n(share: sympy.Expr, total: int) -> int:
        return int(sympy.ceiling(share.subs(N, world_size) * total))

    return Memory(
        parameters=at_n(strategy.parameters, param_bytes),
        gradients=at_n(strategy.gradients, grad_bytes),
        optimizer=at_n(strategy.optimizer, state_bytes),
        activations=activations,
        formula=formula,
        symbolic=symbolic,
    )
