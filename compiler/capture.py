"""What the graphs Dynamo hands us take as inputs: parameters, buffers, user data."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from dpar.core.model_state import slots_of


class InputKind(enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    DATA = "data"  # user inputs, tensor attributes that are not buffers, sizes


@dataclasses.dataclass(frozen=True)
class GraphInput:
    index: int
    name: str
    kind: InputKind
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    # The live parameter or buffer, for the runtime: its slot in the model, so no reference to it keeps
    # swap_tensors (to_empty) from working, and load_state_dict(assign=True)'s new tensor is the one found.
    tensor: Callable[[], torch.Tensor | None] | None

    @property
    def requires_grad(self) -> bool:
        t = self.tensor() if self.tensor is not None else None
        return bool(t is not None and t.requires_grad)


_PATH_PART = re.compile(r"\.?_(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]")


def training_call_kwargs(model: torch.nn.Module, positional: int, given: Sequence[str] = ()) -> dict[str, object]:
    """Keywords to call ``model`` with as a training step calls it: ``use_cache=False`` where its forward takes
    ``use_cache`` and the call sets it neither positionally (``positional`` arguments) nor by name (``given``). A
    Hugging Face model built on meta otherwise makes its key/value cache's empty tensors inside the traced call."""
    arguments = list(inspect.signature(model.forward).parameters)
    unset = "use_cache" in arguments and arguments.index("use_cache") >= positional and "use_cache" not in given
    return {"use_cache": False} if unset else {}


def qualified_name(source_name: str) -> str:
    """``L['self']._modules['fc']._parameters['weight']`` -> ``fc.weight``."""
    parts = ["".join(groups) for groups in _PATH_PART.findall(source_name)]
    parts = [p for p in parts if p not in ("_modules", "_parameters", "_buffers")]
    return ".".join(parts) or source_name


def _source_name(node: fx.Node, index: int) -> str:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source.name if source is not None else f"input_{index}"


def classify_inputs(gm: fx.GraphModule, example_inputs: Sequence[object]) -> list[GraphInput]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise RuntimeError(
            f"dpar internal error: Dynamo graph has {len(placeholders)} inputs but "
            f"{len(example_inputs)} example values"
        )
    kinds = []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        source = _source_name(node, index)
        if isinstance(value, torch.nn.Parameter):
            kind = InputKind.PARAMETER
        elif isinstance(value, torch.Tensor) and "_buffers[" in source:
            kind = InputKind.BUFFER
        else:
            kind = InputKind.DATA
        kinds.append((source, kind))
    state = [v for v, (_, kind) in zip(example_inputs, kinds) if kind is not InputKind.DATA]
    slots = iter(slots_of(state))
    inputs = []
    for index, (value, (source, kind)) in enumerate(zip(example_inputs, kinds)):
        is_state = kind is not InputKind.DATA
        inputs.append(
            GraphInput(
                index=index,
                name=qualified_name(source) if is_state else source,
                kind=kind,
                shape=tuple(value.shape) if is_state else None,
                dtype=value.dtype if is_state else None,
                tensor=next(slots) if is_state else None,
            )
        )
    return inputs
