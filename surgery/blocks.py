"""A model's blocks: its outermost numbered modules (``layers.3``), and what makes two of them alike.

The unit an activation policy is given for, a planner prices once per parity ([Note: repeated blocks share
variables, with period 2] in planner/repeats.py) and the planner's capture and count take a few of
([Note: a capture of the first blocks] in planner/capture.py, the Notes in api/graph_pricing.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch.nn as nn

from dpar.surgery.sharding import block_of

Setting = tuple[str, object]
_PLAIN = (bool, int, float, str, type(None))


def model_blocks(model: nn.Module) -> list[str]:
    """The model's blocks, in module order: its outermost numbered modules (``layers.3``,
    ``transformer.h.0``), the unit an activation policy is given for (``sharding.block_of``)."""
    blocks = dict.fromkeys(block_of(name + ".") for name, _ in model.named_modules() if name)
    return [b for b in blocks if b != "root"]


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential] | None:
    """(its path, the container) where every block of ``model`` is a member of one numbered ``nn.ModuleList`` or
    ``nn.Sequential`` (``layers.0`` ... ``layers.N-1``); None otherwise (no blocks, two lists, gaps)."""
    blocks = model_blocks(model)
    path = blocks[0].rpartition(".")[0] if blocks else ""
    if not path or blocks != [f"{path}.{i}" for i in range(len(blocks))]:
        return None
    container = model.get_submodule(path)
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) != len(blocks):
        return None
    return path, container


def block_settings(blocks: list[nn.Module]) -> list[tuple[Setting, ...]]:
    """Each block's settings: the plain values (numbers, strings, None, tuples of them) its modules hold besides
    their parameters, such as Hugging Face's ``layer_type`` and ``sliding_window``, which make layers with the same
    parameters trace to different graphs (sliding-window and full attention in turn). An integer that numbers the
    blocks (``layer_idx``: block i holds i plus the same offset in every block) is not a setting."""
    def plain(value: object) -> bool:
        return isinstance(value, _PLAIN) or isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)

    held = [{f"{path}.{name}": value for path, module in block.named_modules() for name, value in vars(module).items()
             if not name.startswith("_") and plain(value)} for block in blocks]
    numbering = {key for key, first in held[0].items() if type(first) is int
                 and all(type(h.get(key)) is int and h[key] - i == first for i, h in enumerate(held))}
    return [tuple(sorted((key, value) for key, value in h.items() if key not in numbering)) for h in held]


def with_blocks(model: nn.Module, path: str, kept: Sequence[int]) -> nn.Module:
    """A shallow copy of ``model`` whose block list at ``path`` holds the blocks ``kept``, numbered from 0: the
    modules on the path are copies (of their class, with their attributes), everything else (the kept blocks,
    parameters, buffers, hooks) is ``model``'s own, so nothing is copied and ``model`` is left as it is."""
    def copied(module: nn.Module) -> nn.Module:
        clone = copy.copy(module)
        clone._modules = dict(module._modules)
        return clone

    root = owner = copied(model)
    for part in path.split("."):
        child = copied(owner._modules[part])
        owner._modules[part] = child
        owner = child
    blocks = list(owner._modules.values())
    owner._modules = {str(j): blocks[i] for j, i in enumerate(kept)}
    return root


__all__ = ["block_list", "block_settings", "model_blocks", "with_blocks"]
