"""The hand-written tensor-parallel plan (Megatron-LM): which dimension of each parameter to split.

A Linear is *column* parallel (weight and bias split on dim 0, output split on
its last dim) unless its input comes from a column-parallel Linear through
ops that keep the split hidden dimension independent (activations, views,
attention over split heads, dropout): then it is *row* parallel (weight split
on dim 1), and its partial-sum output ends the pair. An embedding whose weight
a Linear also reads (a tied LM head) is split by vocabulary rows, the
layout the column-parallel head needs; other parameters are replicated.

The pairing comes from running the forward once on fake tensors and following
which Linear each value derives from, not from parameter names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

# Ops through which a column-split hidden dimension stays split, one block of it per rank.
_HEAD_LOCAL = {
    F.gelu, F.relu, F.silu, torch.tanh, torch.sigmoid, F.dropout, F.scaled_dot_product_attention,
    torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.transpose, torch.transpose,
    torch.Tensor.permute, torch.Tensor.contiguous, torch.Tensor.split, torch.Tensor.chunk,
    torch.Tensor.flatten, torch.flatten, torch.Tensor.unflatten, torch.Tensor.__getitem__,
    torch.Tensor.mul, torch.Tensor.__mul__, torch.mul, torch.Tensor.tanh, torch.Tensor.relu,
}


class _Follow(TorchFunctionMode):
    """Tags each tensor with the column Linear it derives from and classifies every Linear it sees."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names  # id(weight) -> parameter name
        self.source: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> column Linear weight name
        self.dims: dict[str, int | None] = {}

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func is F.linear:
            weight, bias = args[1], (args[2] if len(args) > 2 else kwargs.get("bias"))
            name = self.names.get(id(weight))
            row = self.source.get(args[0]) is not None
            if name is not None and name not in self.dims:
                self.dims[name] = 1 if row else 0
                if bias is not None and id(bias) in self.names:
                    self.dims[self.names[id(bias)]] = None if row else 0
            if name is not None and not row:
                tree_map(lambda t: self._tag(t, name), out)
        elif func in _HEAD_LOCAL:
            sources = [self.source.get(t) for t in tensors if t.dim() > 0]
            if sources and None not in sources:  # every operand split alike: so is the result
                tree_map(lambda t: self._tag(t, sources[0]), out)
        return out

    def _tag(self, value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            self.source[value] = name


def megatron_dims(model: nn.Module, example_inputs: Sequence[Any]) -> dict[str, int | None]:
    """Parameter name -> the dimension tensor parallel splits (None: replicated)."""
    names = {id(p): n for n, p in model.named_parameters()}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_inputs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, list(example_inputs))
        follow = _Follow(names)
        with follow, torch.no_grad():
            model(*fake_inputs)
    dims = {name: follow.dims.get(name) for name in names.values()}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            name = names[id(module.weight)]
            if follow.dims.get(name) == 0:  # tied to a column-parallel head
                dims[name] = 0
    return dims
