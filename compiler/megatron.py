"""The hand-written tensor-parallel plan (Megatron-LM): which dimension of each parameter to split.

A Linear is *column* parallel (``rules.COLUMN``: weight and bias split on their
output dimension, output split on its last dim) unless its input is a
column-parallel Linear's output still split along its last dim, through ops that
keep each rank's block of hidden units independent: then it is *row* parallel
(``rules.ROW``: weight split on its input dimension), and its partial-sum output
ends the pair. An embedding whose weight a Linear also reads (a tied LM head)
takes the head's split: by vocabulary rows (``rules.VOCAB``) under a column
head. Other parameters are replicated.

The pairing comes from running the forward once on fake tensors and following,
for every value derived from a column-parallel output, which dimension carries
the split (``_Split``): views that split the hidden size into heads move it to
the heads, attention keeps it there, and an operand broadcast along it (an
attention mask, RoPE's cos/sin, a relative position bias) leaves it alone. An
op that combines values across it (a norm over the hidden size, a contraction)
makes the result ``_MIXED``, and a Linear reading that is column parallel
again. This only chooses the plan: sharding propagation places every value
exactly whatever the plan, so a wrong guess costs communication, not numbers.

``RULES`` below is not ``propagation.rules.RULES`` again: it runs on the eager
forward's torch functions, before any graph is traced (the plan must be chosen
before compiling), and follows one thing only, where the split of a column
Linear's units goes; propagation places every ATen op of the traced forward and
backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from dpar.compiler.propagation.rules import COLUMN, ROW, view_dim
from dpar.core.torch_internals import FakeTensorMode, grouped_mm, pytree


@dataclasses.dataclass(frozen=True)
class _Split:
    """A value holding one block per rank along ``dim`` of the units of the column Linear ``source``."""

    source: str
    dim: int


_MIXED = "mixed"  # derived from a split value across its split dimension: no longer a block per rank
State = _Split | str | None  # None: independent of every column-parallel output

Rule = Callable[[Any, tuple, dict, list[torch.Tensor], list[State]], Any]


def _dim(args: tuple, kwargs: dict, index: int, default: int | None = None) -> Any:
    return args[index] if len(args) > index else kwargs.get("dim", default)


def _aligned(out: torch.Tensor, operands: list[torch.Tensor], states: list[State]) -> int | str:
    """Broadcasting: every split operand's dim, counted from the right, must agree; others broadcast."""
    dims = {out.dim() - t.dim() + s.dim for t, s in zip(operands, states) if isinstance(s, _Split)}
    return dims.pop() if len(dims) == 1 else _MIXED


def _pointwise(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    return _aligned(out, operands, states)


def _viewed(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    dim = view_dim(tuple(operands[0].shape), tuple(out.shape), states[0].dim, tp=1)
    return _MIXED if dim is None else dim


def _transposed(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    ndim, dim = operands[0].dim(), states[0].dim
    pair = [d % ndim for d in (args[1:3] if len(args) >= 3 else (0, 1))]
    return pair[1] if dim == pair[0] else pair[0] if dim == pair[1] else dim


def _permuted(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    order = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    return [d % operands[0].dim() for d in order].index(states[0].dim)


def _expanded(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    dim = states[0].dim + out.dim() - operands[0].dim()
    return dim if out.shape[dim] == operands[0].shape[states[0].dim] else _MIXED


def _indexed(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    """``x[...]`` with slices, integers, None and Ellipsis; a cut across the split dim, or a tensor index, mixes."""
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(isinstance(i, torch.Tensor) or isinstance(i, (list, bool)) for i in index):
        return _MIXED
    consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (operands[0].dim() - consumed) + index[at + 1:]
    dim, out_dim = states[0].dim, 0
    for position in range(operands[0].dim()):  # input dims in order, with the output dim each becomes
        while index and index[0] is None:
            index, out_dim = index[1:], out_dim + 1
        entry, index = (index[0], index[1:]) if index else (slice(None), ())
        if position == dim:
            whole = isinstance(entry, slice) and entry == slice(None)
            return out_dim if whole else _MIXED
        out_dim += isinstance(entry, slice)
    return _MIXED


def _cut(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    """split / chunk along ``dim``: a split along another dim stays where it is."""
    dim = _dim(args, kwargs, 2, 0) % operands[0].dim()
    return _MIXED if dim == states[0].dim else states[0].dim


def _softmax(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    dim = _dim(args, kwargs, 1)
    return _MIXED if dim is None or dim % operands[0].dim() == states[0].dim else states[0].dim


def _reduced(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    ndim, dim = operands[0].dim(), states[0].dim
    dims = _dim(args, kwargs, 1)
    if dims is None:
        return _MIXED
    dims = {d % ndim for d in (dims if isinstance(dims, (list, tuple)) else (dims,))}
    if dim in dims:
        return _MIXED
    return dim if out.dim() == ndim else dim - sum(d < dim for d in dims)


def _joined(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    """cat along another dim of pieces split alike (RoPE's rotate_half); an empty 1-D piece
    (a cache's first step) is skipped, as cat does."""
    dim = _dim(args, kwargs, 1, 0) % out.dim()
    pieces = [(t, s) for t, s in zip(operands, states) if t.shape != (0,)]
    split = {s.dim for _, s in pieces if isinstance(s, _Split)}
    return split.pop() if len(split) == 1 and dim not in split and all(t.dim() == out.dim() for t, _ in pieces) else _MIXED


def _normalized(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
    return _MIXED if states[0].dim >= operands[0].dim() - len(shape) else states[0].dim


def _batched_product(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    """matmul over split heads (``q @ k.transpose(-1, -2)``): a split batch dim stays; a split
    contraction dim is a partial sum, so mixed."""
    dim = _aligned(out, operands, states)
    return dim if dim != _MIXED and dim < out.dim() - 2 else _MIXED


def _attention(out: Any, args: tuple, kwargs: dict, operands: list[torch.Tensor], states: list[State]) -> Any:
    """Scaled dot-product attention over split heads (dim -3 of q, k and v); the mask broadcasts."""
    heads = [s.dim - t.dim() for t, s in zip(operands[:3], states[:3]) if isinstance(s, _Split)]
    return out.dim() - 3 if heads and set(heads) == {-3} and not any(s is _MIXED for s in states[3:]) else _MIXED


_T = torch.Tensor
# How each op moves a split, by the torch function the forward calls. An op not listed mixes.
RULES: dict[Any, Rule] = {
    **dict.fromkeys([
        F.gelu, F.relu, F.silu, F.dropout, torch.tanh, torch.sigmoid, torch.exp, torch.pow, torch.where,
        torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.rsqrt,
        _T.mul, _T.__mul__, _T.__rmul__, _T.add, _T.__add__, _T.__radd__, _T.sub, _T.__sub__, _T.__rsub__,
        _T.div, _T.__truediv__, _T.__rtruediv__, _T.neg, _T.__neg__, _T.pow, _T.__pow__, _T.tanh, _T.relu,
        _T.sigmoid, _T.exp, _T.masked_fill, _T.to, _T.float, _T.type_as, _T.contiguous, _T.clone,
    ], _pointwise),
    **dict.fromkeys([
        _T.view, _T.reshape, torch.reshape, _T.flatten, torch.flatten, _T.unflatten, _T.view_as,
        _T.unsqueeze, torch.unsqueeze, _T.squeeze, torch.squeeze,
    ], _viewed),
    **dict.fromkeys([_T.transpose, torch.transpose, _T.swapaxes, _T.t, torch.t], _transposed),
    **dict.fromkeys([_T.permute, torch.permute], _permuted),
    **dict.fromkeys([_T.expand, _T.expand_as], _expanded),
    _T.__getitem__: _indexed,
    **dict.fromkeys([_T.split, torch.split, _T.chunk, torch.chunk], _cut),
    **dict.fromkeys([F.softmax, torch.softmax, _T.softmax, F.log_softmax, _T.log_softmax], _softmax),
    **dict.fromkeys([torch.sum, _T.sum, torch.mean, _T.mean], _reduced),
    **dict.fromkeys([torch.cat, torch.concat], _joined),
    **dict.fromkeys([F.layer_norm, F.rms_norm], _normalized),
    **dict.fromkeys([torch.matmul, _T.matmul, _T.__matmul__, torch.bmm], _batched_product),
    F.scaled_dot_product_attention: _attention,
}

# Rules that read every operand's split; the others transform their first operand's.
_ANY_OPERAND = {_pointwise, _joined, _attention, _batched_product}


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, *args: Any, out_dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
    """``torch._grouped_mm``'s fake kernel takes bf16 only, while its CPU kernel also runs float32
    (Hugging Face Mixtral's experts call it so, eagerly): planning needs only the result's shape."""
    return grouped_mm(a.bfloat16(), b.bfloat16(), *args, **kwargs).to(out_dtype or a.dtype)


# Ops whose fake kernel refuses inputs the real one takes: what computes their fake result instead.
_FAKE_STAND_INS: dict[Any, Callable[..., Any]] = {grouped_mm: _grouped_mm_shape}


def _linear(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int] | None:
    """(input, weight, bias, weight's output dim) of a Linear: ``F.linear`` or GPT-2's ``Conv1D``
    (``addmm(bias, x, weight)`` with the weight stored (in, out))."""
    if func is F.linear:
        return args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"), 0
    if func is torch.addmm and len(args) == 3:
        return args[1], args[2], args[0], 1
    return None


class _Follow(TorchFunctionMode):
    """Follows each value's split (``State``) and classifies every Linear it sees."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names  # id(parameter) -> parameter name
        self.state: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> _Split or _MIXED
        self.dims: dict[str, int | None] = {}
        # Column Linear -> the fewest units a view splits its output's block into (its attention heads).
        self.units: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = _FAKE_STAND_INS.get(func, func)(*args, **kwargs)
        linear = _linear(func, tuple(args), kwargs)
        if linear is not None and id(linear[1]) in self.names:
            self._classify(out, *linear)
            return out
        operands = [t for t in pytree.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        states = [self.state.get(t) for t in operands]
        if all(s is None for s in states):
            return out
        rule = RULES.get(func)
        if rule is None or _MIXED in states or (rule not in _ANY_OPERAND and not isinstance(states[0], _Split)):
            self._mark(out, _MIXED)
            return out
        source = next(s.source for s in states if isinstance(s, _Split))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for value in outputs:
            if isinstance(value, torch.Tensor):
                dim = rule(value, tuple(args), kwargs, operands, states)
                self.state[value] = _MIXED if dim is _MIXED else _Split(source, dim)
                if rule is _viewed and dim is not _MIXED and value.shape[dim] != operands[0].shape[states[0].dim]:
                    self.units[source] = min(self.units.get(source, value.shape[dim]), value.shape[dim])
        return out

    def _classify(self, out: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dim: int) -> None:
        """Row parallel where the input arrives as ``ROW`` reads it (split along its last dim, the
        units this Linear contracts), else column parallel; first use decides."""
        state = self.state.get(x)
        layout = ROW if isinstance(state, _Split) and state.dim == ROW.inputs[0].dim % x.dim() else COLUMN
        name = self.names[id(weight)]
        if name not in self.dims:
            dim = layout.params[0].dim  # of a (out, in) weight; GPT-2's Conv1D stores it (in, out)
            self.dims[name] = dim if out_dim == 0 else 1 - dim
            if bias is not None and id(bias) in self.names:
                self.dims[self.names[id(bias)]] = getattr(layout.params[1], "dim", None)
        if layout is COLUMN:
            self.state[out] = _Split(name, COLUMN.outputs[0].dim % out.dim())

    def _mark(self, value: Any, state: State) -> None:
        pytree.tree_map(lambda t: self.state.__setitem__(t, state) if isinstance(t, torch.Tensor) else None, value)


@dataclasses.dataclass(frozen=True)
class MegatronPlan:
    """``dims``: parameter name -> the dimension tensor parallel splits (None: replicated). ``units``: column
    Linear weight name -> how many units (attention heads) a view cuts its output's split dimension into,
    which the tensor-parallel degree must divide for the heads to stay whole on each rank."""

    dims: dict[str, int | None]
    units: dict[str, int]


def megatron_dims(model: nn.Module, example_inputs: Sequence[Any]) -> dict[str, int | None]:
    """Parameter name -> the dimension tensor parallel splits (None: replicated)."""
    return megatron_plan(model, example_inputs).dims


def megatron_plan(model: nn.Module, example_inputs: Sequence[Any]) -> MegatronPlan:
    """The split of each parameter and the heads of each column Linear, from one forward on fake tensors."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
        # Fake copies of the state too: a real buffer updated in place under the fake mode (BatchNorm's
        # 0-dim num_batches_tracked) would otherwise count this planning forward as a training step.
        parameters = {n: fake(p) for n, p in model.named_parameters()}
        state = {**parameters, **{n: fake(b) for n, b in model.named_buffers()}}
        follow = _Follow({id(p): n for n, p in parameters.items()})
        with follow, torch.no_grad():
            functional_call(model, state, tuple(pytree.tree_map(fake, list(example_inputs))))
    # A tied embedding's weight was classified where the head read it: its split is the head's.
    return MegatronPlan({name: follow.dims.get(name) for name in parameters}, dict(follow.units))
