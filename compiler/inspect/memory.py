"""Per-rank memory: parameters, gradients, optimizer state, and an activation peak estimate."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import sympy
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

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


def _storage(val: object) -> tuple[object, int] | None:
    if not isinstance(val, torch.Tensor):
        return None
    storage = val.untyped_storage()
    return StorageWeakRef(storage), int(storage.nbytes())


def _node_storages(node: fx.Node) -> list[tuple[object, int]]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [s for s in map(_storage, vals) if s is not None]


def _live_peak(gm: fx.GraphModule, live_inputs: set[str], exclude_outputs: bool) -> tuple[int, int]:
    """(peak, live at the end) of bytes of storages created in ``gm`` or named in ``live_inputs``.

    A storage dies after the last node that reads it, unless the graph returns it.
    Backward graphs pass ``exclude_outputs``: what they return is the gradients.
    """
    nodes = list(gm.graph.nodes)
    outputs = set(gm.graph.output_node().all_input_nodes)
    last_use = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = i
    owner: dict[object, int] = {}  # storage -> bytes, counted once
    kept = {s for n in outputs for s, _ in _node_storages(n)}
    alive_until: dict[object, int] = {}
    live = peak = 0
    for i, node in enumerate(nodes):
        if node.op == "placeholder" and node.name not in live_inputs:
            continue
        for storage, nbytes in _node_storages(node):
            if storage not in owner:
                if exclude_outputs and storage in kept:
                    owner[storage] = 0
                    continue
                owner[storage] = nbytes
                live += nbytes
            end = len(nodes) if storage in kept else last_use.get(node, i)
            alive_until[storage] = max(alive_until.get(storage, i), end)
        peak = max(peak, live)
        for storage in [s for s, end in alive_until.items() if end == i]:
            live -= owner[storage]
            del alive_until[storage]
    return peak, live


def activation_peak(pairs: Sequence[tuple[fx.GraphModule, fx.GraphModule | None]]) -> int:
    """Peak activation bytes over the forward graphs in order, then the backward graphs in reverse.

    What a forward graph returns (saved activations, outputs) stays live until
    its backward; parameters and user inputs are not activations.
    """
    peak = saved = 0
    saved_by_graph = []
    for forward, _ in pairs:
        fw_peak, fw_end = _live_peak(forward, set(), exclude_outputs=False)
        peak = max(peak, saved + fw_peak)
        saved += fw_end
        saved_by_graph.append(fw_end)
    for (forward, backward), fw_end in reversed(list(zip(pairs, saved_by_graph))):
        saved -= fw_end
        if backward is None:
            continue
        primals = {n.name for n in forward.graph.nodes if n.op == "placeholder"}
        inputs = {n.name for n in backward.graph.nodes if n.op == "placeholder"} - primals
        bw_peak, _ = _live_peak(backward, inputs, exclude_outputs=True)
        peak = max(peak, saved + bw_peak)
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
