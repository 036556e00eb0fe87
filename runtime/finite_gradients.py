"""``options={"check_finite": True}``: a backward whose gradients hold nan or inf raises, naming the parameters.

[Note: where the finite check runs, and why it is opt-in]
The check wraps each compiled backward and reads the gradients it returns, after their reduction
(all-reduce, reduce-scatter), before autograd stores them in ``.grad``: raising there leaves ``.grad``
as it was before the backward, and no optimizer steps on nan. One sum per gradient screens them (a
nan or inf element makes the sum non-finite); only a gradient whose sum is not finite is searched for
nan and inf. Where ranks return
different gradients (shards, tensor-parallel blocks, local SGD's replicas) one rank may see a nan the
others do not: the flags are all-reduced (max) over the world, so every rank raises the same error
instead of some stepping on while others stop (which would hang). ddp's and zero1's all-reduced
gradients are the same on every rank, and need no agreement. Under ``no_sync`` nothing is checked:
the synchronising backward checks the accumulated total.

It costs a read of the gradients and a host sync per backward (which on a GPU stops the CPU from
queueing the next step ahead), and an all-reduce of 2 floats per parameter where ranks differ, so it
is off by default, like torch's anomaly detection.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dpar.core.errors import NonFiniteGradientError
from dpar.runtime.gradient_sync import inside_no_sync


class FiniteGradients:
    """A compiled backward, boxed as AOTAutograd calls it, that raises on non-finite gradients.

    ``parameters`` maps each backward output (a forward input's position) to the parameter's name
    and live tensor; ``agree`` says whether ranks must agree on the flags (see the Note).
    """

    def __init__(
        self, backward: Callable[..., Any], parameters: dict[int, tuple[str, weakref.ref]], agree: bool
    ) -> None:
        self._boxed_call = True
        self._backward, self._parameters, self._agree = backward, parameters, agree
        self.calls = 0

    def __call__(self, args: list[Any]) -> Any:
        live = [p for _, ref in self._parameters.values() if (p := ref()) is not None]
        skip = inside_no_sync(live)
        outputs = self._backward(args)
        self.calls += 1
        if not skip:
            self._check(outputs)
        return outputs

    def _check(self, outputs: Sequence[Any]) -> None:
        checked = [
            (name, outputs[i]) for i, (name, _) in self._parameters.items()
            if i < len(outputs) and isinstance(outputs[i], torch.Tensor)
        ]
        if not checked:
            return
        # Screen: a nan or inf element makes its gradient's sum nan or inf (the cheapest reduction on
        # CPU: an inf-norm or isfinite().all() is 10-25x slower). Confirm the few suspects exactly: a
        # sum of finite values can also overflow.
        sums = torch.stack([g.sum(dtype=torch.float32) for _, g in checked])
        flags = torch.zeros(2, len(checked), device=sums.device)
        for j in (~sums.isfinite()).nonzero().flatten().tolist():
            gradient = checked[j][1]
            flags[0, j], flags[1, j] = float(gradient.isnan().any()), float(gradient.isinf().any())
        if self._agree:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not bool(flags.any()):
            return
        found = [
            f"{name} ({' and '.join(kind for kind, flag in zip(('nan', 'inf'), flags[:, j].tolist()) if flag)})"
            for j, (name, _) in enumerate(checked) if flags[:, j].any()
        ]
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        raise NonFiniteGradientError(
            f"non-finite gradients in backward call #{self.calls} of this graph: {shown}. This graph's gradients were "
            "not stored and no optimizer has stepped on them: call optimizer.zero_grad() and go on with the next "
            "batch to skip this step, or find the cause (a loss or input holding nan/inf, a learning rate that "
            "diverges; torch.autograd.detect_anomaly names the op). options={'check_finite': True} raises this"
        )


__all__ = ["FiniteGradients"]
