"""The marker op through which a context-parallel graph reads each sequence-long input.

[Note: a sequence split over a context-parallel group]
Under cp every rank of a group computes its share of the same sequences: its two
chunks of each (see [Note: a sequence's two chunks per rank] in
``compiler/propagation/redistribute.py``). Before AOTAutograd traces the program,
each user input whose dim 1 is as long as the sequence is read through
``dpar::sequence_split(x, 1)``, an identity op whose value keeps the whole
sequence, so the joint graph is the single-device program with global shapes.
The context-parallel pass (``compiler/passes/context_parallel.py``) seeds sharding
propagation from these markers (each is this rank's chunks of its input), lets it
carry the split through every op that treats tokens independently, insert the
exchanges where an op needs other ranks' tokens (attention's keys and values
all-gathered, their gradients reduce-scattered) and the reductions where a sum runs
over tokens (the loss, every parameter's gradient), and then removes the markers.
Nothing of cp is in the parameters: they are whole on every rank of the group.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("dpar::sequence_split", mutates_args=())
def sequence_split(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Marks an input split along ``dim`` over the context-parallel group; identity when run as is."""
    return x.clone()


@sequence_split.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty_like(x)


sequence_split.register_autograd(lambda ctx, grad: (grad, None))

SEQUENCE_SPLIT = torch.ops.dpar.sequence_split.default
