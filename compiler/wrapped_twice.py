"""Another data-parallel wrapper around a dpar model, caught when its first graph compiles.

[Note: wrapped twice]
dpar inserts the gradient synchronisation into the graphs, so a library that also wraps the model
in torch's ``DistributedDataParallel`` (Hugging Face's Trainer does under torchrun) reduces every
gradient a second time: under ddp the average of equal averages is the same average, so the numbers
hide it and only the step time shows it. DDP marks the module whose forward it runs (for Dynamo's
DDPOptimizer), and the backend reads that mark. Parameters that are DTensors dpar did not place
(torch's ``parallelize_module``) would be treated as dpar's own. Both are refused by name, saying
which wrapper and how to leave it out. Observed on torch 2.13 and not refused here: Dynamo does not
reach a backend at all for ``torch.compile(DistributedDataParallel(model))`` nor for a module under
FSDP2's ``fully_shard`` (they run as torch's eager DDP/FSDP2, reduced once); FSDP1 needs an
accelerator.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from dpar.core import model_state
from dpar.core.errors import LEAVE_DDP_OUT, WrappedTwiceError
from dpar.core.torch_internals import active_ddp_module


def check_not_wrapped(parameters: Mapping[str, torch.Tensor]) -> None:
    """Refuse a graph compiled inside another data-parallel wrapper (see [Note: wrapped twice])."""
    ddp = active_ddp_module()
    if ddp is not None:
        raise WrappedTwiceError(
            f"this dpar-compiled model runs inside torch.nn.parallel.DistributedDataParallel "
            f"({type(getattr(ddp.module, '_orig_mod', ddp.module)).__name__} wrapped by {type(ddp).__name__}): " + LEAVE_DDP_OUT
        )
    owners = model_state.owners_of(parameters.values())
    foreign = [name for (name, t), owner in zip(parameters.items(), owners) if isinstance(t, DTensor) and owner is None]
    if foreign:
        raise WrappedTwiceError(
            f"parameters {foreign[:3]}{' ...' if len(foreign) > 3 else ''} are DTensors dpar did not place (FSDP2's "
            "fully_shard or torch's parallelize_module): dpar places parameters itself. Leave the other wrapper out "
            "and ask dpar for the same layout: dpar.parallelize(model, strategy='fsdp' | 'tp' | 'fsdp+tp', mesh=...)"
        )
