"""The knobs ``torch.compile(..., backend="dpar", options={...})`` accepts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dpar.compiler.lowering import INNER_COMPILERS
from dpar.core.errors import OptionsError


DDP_BUCKET_CAP_MB = 25.0


@dataclasses.dataclass(frozen=True)
class Options:
    bucket_cap_mb: float | None = None
    """Gradient bucket size under ddp (and ddp+tp, zero1), as DDP's ``bucket_cap_mb`` (MiB): a number gives DDP's
    greedy buckets exactly; None plans them from cost under DDP's 25 MiB bound (compiler/passes/bucket_schedule.py).
    Sharded strategies lay out their buckets in ``parallelize``, which takes the same knob."""
    compiler: str = "inductor"
    """Inner compiler for the post-pass graphs: inductor, aot_eager or eager (fx.Interpreter)."""
    broadcast_buffers: bool = True
    """Every forward reads rank 0's buffers, as DDP's ``broadcast_buffers``."""
    sink_waits: bool = True
    """Move each wait as late as the graph allows (False keeps it next to its collective)."""
    check_timeout_s: float = 120.0
    """How long a rank waits for the others at a cross-rank consistency check."""
    optimizer_in_graph: bool | None = None
    """Compile the step of every optimizer over this model's parameters with Inductor, from its second step
    (see [Note: the optimizer step in the graph] in runtime/optimizer_graph.py); None: when ``compiler`` is inductor."""
    check_finite: bool = False
    """Raise ``NonFiniteGradientError`` naming each parameter whose gradient holds nan or inf
    (see [Note: where the finite check runs, and why it is opt-in] in runtime/finite_gradients.py)."""

    @property
    def steps_optimizer_in_graph(self) -> bool:
        return self.compiler == "inductor" if self.optimizer_in_graph is None else self.optimizer_in_graph

    @property
    def bucket_cap_bytes(self) -> int:
        return max(1, int((DDP_BUCKET_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb) * 1024 * 1024))

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> Options:
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise OptionsError(f"unknown dpar option(s) {unknown}; valid keys are {valid}")
        parsed = cls(**options)
        parsed._validate()
        return parsed

    def _validate(self) -> None:
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise OptionsError(
                f"bucket_cap_mb must be a number of MiB greater than 0, got {cap!r}; "
                "for example options={'bucket_cap_mb': 25}"
            )
        if self.compiler not in INNER_COMPILERS:
            raise OptionsError(
                f"compiler must be one of {list(INNER_COMPILERS)}, got {self.compiler!r}"
            )
        for flag in ("broadcast_buffers", "sink_waits", "check_finite"):
            if not isinstance(getattr(self, flag), bool):
                raise OptionsError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.optimizer_in_graph is not None and not isinstance(self.optimizer_in_graph, bool):
            raise OptionsError(
                f"optimizer_in_graph must be True, False or None (True when compiler is inductor), "
                f"got {self.optimizer_in_graph!r}"
            )
        timeout = self.check_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise OptionsError(f"check_timeout_s must be a positive number of seconds, got {timeout!r}")
