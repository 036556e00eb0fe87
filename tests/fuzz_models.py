"""Small random models for the fuzz tests: a frozen spec that prints as a pasteable literal.

A failing spec found by ``tests/test_fuzz_strategies.py`` reads like
``ModelSpec(inputs=5, widths=(3,), outputs=2, tokens=True, tie_head=True, ...)``: paste it into
that file's regression list and the same model is built again, bit for bit.

The model is a stack of layers over ``dims = (inputs, *widths, outputs)``; layer ``i`` maps
``dims[i]`` to ``dims[i + 1]``. What each field adds, and which part of dpar it stresses:

- ``tokens``: layer 0 is an ``Embedding`` of ``inputs`` rows (token ids in, cross-entropy out);
  ``tie_head`` makes the last layer read the embedding's weight (one parameter, two uses);
- ``repeat``: a square layer applied twice (a weight read twice in one graph);
- ``frozen``: layers whose parameters do not train (no gradient, left out of every bucket);
- ``unused``: a layer the forward never reads (DDP needs ``find_unused_parameters``);
- ``norm``: LayerNorm or BatchNorm after layer 0 (BatchNorm: running statistics, buffers);
- ``scale``: a constant buffer the forward multiplies by;
- ``block``: after layer 0, ``"conv"`` (a 1-D convolution over the features, BatchNorm, its
  channels summed back) or ``"moe"`` (a top-1 mixture of two experts: a router Linear, token
  routing by argmax, the experts' weights one 3-D parameter read by a batched matmul). Tensor
  parallel cannot split their weights (no rule keeps a convolution's or a routed expert's
  block): its plan must keep them replicated, and the Linears around them still split.
Widths are drawn from 1 to 12, so most do not divide the world size (uneven shards, empty
shards at width 1, tensor-parallel blocks of unequal size).

[Note: models whose gradient is rounding noise]
A parameter whose true gradient is zero gets a gradient of fp32 rounding noise, and AdamW
turns noise of any size into steps of size lr, so two correct programs that sum in another
order (tensor parallel does) end 1e-3 apart. The generator leaves such models out: LayerNorm
over 1 or 2 features (its output is then the same for whatever feeds it), BatchNorm over
token embeddings (3 rows per rank often hold 2 distinct ids: the same invariance along the
batch), a norm after ReLU (its zeros give that case again; a unit active on every row makes
the bias before it a shift that BatchNorm removes) and one-class cross-entropy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

ACTIVATIONS = {"tanh": torch.tanh, "gelu": F.gelu, "relu": F.relu}


@dataclasses.dataclass(frozen=True, repr=False)
class ModelSpec:
    inputs: int  # input features, or the vocabulary under ``tokens``
    widths: tuple[int, ...]  # hidden widths
    outputs: int
    tokens: bool = False
    tie_head: bool = False  # tokens only: the last layer is the embedding's transpose
    bias: bool = False  # the defaults are what hypothesis shrinks towards, so a shrunk spec prints short
    activation: str = "gelu"
    frozen: tuple[int, ...] = ()  # indices of layers that do not train
    repeat: int | None = None  # index of a square Linear applied twice
    unused: bool = False
    norm: str = "none"  # "none", "layer" or "batch", after layer 0
    scale: bool = False
    seed: int = 0  # the initial weights
    block: str = "none"  # "none", "conv" or "moe", after layer 0 (and its norm)

    def __repr__(self) -> str:
        """The fields that differ from their defaults: a short literal that builds the same model."""
        shown = [f for f in dataclasses.fields(self) if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default]
        return f"ModelSpec({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.inputs, *self.widths, self.outputs)


class FuzzNet(nn.Module):
    """The model a ``ModelSpec`` describes."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        d = spec.dims
        layers: list[nn.Module] = []
        for i in range(len(d) - 1):
            if i == 0 and spec.tokens:
                layers.append(nn.Embedding(d[0], d[1]))
            else:
                layers.append(nn.Linear(d[i], d[i + 1], bias=spec.bias))
        if spec.tie_head:
            layers[-1].weight = layers[0].weight
        self.layers = nn.ModuleList(layers)
        self.norm = {"none": None, "layer": nn.LayerNorm(d[1]), "batch": nn.BatchNorm1d(d[1])}[spec.norm]
        if spec.scale:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, d[1]))
        if spec.unused:
            self.unused = nn.Linear(3, 2)
        if spec.block == "conv":  # no bias: BatchNorm removes it, its gradient would be rounding noise
            self.conv = nn.Sequential(nn.Conv1d(1, 2, 3, padding=1, bias=False), nn.BatchNorm1d(2))
        if spec.block == "moe":
            self.router = nn.Linear(d[1], 2)
            self.experts = nn.Parameter(torch.randn(2, d[1], d[1]) / d[1] ** 0.5)
        for i in spec.frozen:
            self.layers[i].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS[self.spec.activation]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            for _ in range(2 if i == self.spec.repeat else 1):
                x = layer(x)
                if i < last:
                    x = act(x)
            if i == 0 and self.norm is not None:
                x = self.norm(x)
            if i == 0 and self.spec.scale:
                x = x * self.scale
            if i == 0 and self.spec.block != "none":
                x = self._block(x)
        return x

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.block == "conv":
            return x + torch.tanh(self.conv(x.unsqueeze(1))).sum(1)
        gates = torch.softmax(self.router(x), -1)
        weight, expert = gates.max(-1)  # each row goes to one expert, scaled by its gate (so the router trains)
        return x + weight.unsqueeze(-1) * torch.bmm(self.experts[expert], x.unsqueeze(-1)).squeeze(-1)


def build(spec: ModelSpec) -> FuzzNet:
    torch.manual_seed(spec.seed)
    return FuzzNet(spec)


def global_batch(spec: ModelSpec, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch of ``rows`` rows; rank r is fed ``chunk(world)[r]`` of it."""
    g = torch.Generator().manual_seed(7919 * step + spec.seed)
    if spec.tokens:
        return torch.randint(0, spec.inputs, (rows,), generator=g), torch.randint(0, spec.outputs, (rows,), generator=g)
    return torch.randn(rows, spec.inputs, generator=g), torch.randn(rows, spec.outputs, generator=g)


def loss_of(spec: ModelSpec, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out, y) if spec.tokens else F.mse_loss(out, y)


def trains_something(spec: ModelSpec) -> bool:
    """Whether the forward reads a parameter that trains (else the loss has no gradient at all)."""
    return any(p.requires_grad for name, p in build(spec).named_parameters() if not name.startswith("unused."))


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    """Any small ``ModelSpec``; hypothesis shrinks towards fewer, narrower layers and fewer features."""
    width = st.integers(1, 12)
    tokens = draw(st.booleans())
    inputs = draw(st.integers(2, 9) if tokens else width)
    widths = tuple(draw(st.lists(width, min_size=1 if tokens else 0, max_size=3)))
    tie_head = tokens and len(widths) >= 1 and draw(st.booleans())
    if tie_head:  # the head reads the embedding's (inputs, widths[0]) weight as its transpose
        widths = (*widths[:-1], widths[0]) if len(widths) > 1 else widths
        outputs = inputs
    else:
        outputs = draw(st.integers(2, 9) if tokens else width)  # see [Note: models whose gradient is rounding noise]
    dims = (inputs, *widths, outputs)
    layers = len(dims) - 1
    square = [i for i in range(1 if tokens else 0, layers) if dims[i] == dims[i + 1]]
    if tie_head:  # the tied head is not repeated: its weight already has two uses
        square = [i for i in square if i != layers - 1]
    activation = draw(st.sampled_from(sorted(ACTIVATIONS)))
    norms = ["none"]  # see [Note: models whose gradient is rounding noise]
    if layers > 1 and dims[1] >= 3 and activation != "relu":
        norms += ["layer"] + ([] if tokens else ["batch"])
    spec = ModelSpec(
        inputs=inputs,
        widths=widths,
        outputs=outputs,
        tokens=tokens,
        tie_head=tie_head,
        bias=draw(st.booleans()),
        activation=activation,
        frozen=tuple(sorted(draw(st.sets(st.integers(0, layers - 1), max_size=layers - 1)))),
        repeat=draw(st.none() | st.sampled_from(square)) if square else None,
        unused=draw(st.booleans()),
        norm=draw(st.sampled_from(norms)),
        scale=draw(st.booleans()) if layers > 1 else False,
        seed=draw(st.integers(0, 3)),
    )
    # Drawn last, so the fields above are drawn as before. Not after ReLU: see the Note.
    if layers > 1 and dims[1] >= 3 and activation != "relu" and not tokens:
        spec = dataclasses.replace(spec, block=draw(st.sampled_from(["none", "conv", "moe"])))
    return spec if trains_something(spec) else dataclasses.replace(spec, frozen=())
