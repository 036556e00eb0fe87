"""Expert parallelism while training: each routed token sent to the rank that holds its expert, and back.

[Note: routed tokens in fixed-size buffers]
A mixture-of-experts layer routes each of a rank's T tokens to k experts; under expert parallelism the
E experts are split over the ``ep`` ranks (E / ep each, in order), so every (token, expert) pair must
travel to its expert's rank and its output back. How many pairs go to each rank is known only once the
router has run. Two ways to move them: exchange the counts first and size the all-to-all by them (a host
sync, and shapes that change every step: the graphs would recompile per step or carry unbacked sizes
through every pass and cost model), or send fixed buffers large enough for any routing. dpar sends fixed
buffers: each rank sends every other rank a block of T * k rows (all of its pairs could go to one rank),
its pairs in their slots and zeros elsewhere, with each row's local expert id (``local``, the sentinel,
for an empty slot). Every shape is then static: one compiled graph for every step, no host sync, and the
exchange is an ordinary collective in the graph that dpar's passes and cost model see with its bytes.
Nothing is dropped, whatever the routing (no capacity factor). The price is the buffer: ep times the
bytes of a perfectly balanced exchange, and an expert computation over ep * T * k rows of which T * k
are routed on average (a grouped matmul with offsets, Hugging Face's ``grouped_mm``, skips the empty
slots; the fallback loops compute them and multiply by zero). Exchanging counts first is the next step
for large ep, where that factor matters.

The experts module computes its own rows: it is called on the received rows with ``top_k = 1``, weight
1.0 and local expert ids (the sentinel ``local`` marks an empty slot, which the module must map to zero:
Hugging Face's experts do under ``_is_expert_parallel``), so its own kernels, activation and layout apply.
The routing weights are applied on the sending rank, after the outputs come back, then the k outputs of
a token summed, as the single-device module does, so the router's gradient never crosses ranks.

Gradients: an expert's weights see the pairs of every rank of the ep group, so the backward's all-to-all
leaves their gradient summed over those ranks, where DDP would average it. The experts' output gradient is
scaled by 1 / ep and their input gradient by ep, so the weights' gradients come out averaged and the
tokens' gradients as computed (exact for ep a power of two, one rounding otherwise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from dpar.core.torch_internals import all_to_all_single, all_to_all_single_autograd


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How one experts module is split: ``num_experts`` over all ranks, ``ep_size`` ranks of ``group_name``."""

    num_experts: int
    ep_size: int
    group_name: str

    @property
    def local(self) -> int:
        """Experts on each rank (the sentinel id of an empty slot)."""
        return self.num_experts // self.ep_size


class _ScaledGradient(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def exchange(
    module: nn.Module, forward: Callable[..., torch.Tensor], layout: ExpertLayout,
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts module's output for this rank's tokens, its experts spread over the ep group: dispatch,
    ``forward`` on this rank's experts, combine (see [Note: routed tokens in fixed-size buffers])."""
    tokens, width = hidden_states.shape
    k = top_k_index.shape[-1]
    pairs, ep, local = tokens * k, layout.ep_size, layout.local
    device = hidden_states.device
    expert = top_k_index.reshape(-1)
    owner = torch.div(expert, local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    owner_sorted = owner[order]
    counts = nn.functional.one_hot(owner, ep).sum(0)
    first = counts.cumsum(0) - counts
    # The slot of each pair (in owner order) in the send buffer: block ``owner``, then its place among them.
    slot = owner_sorted * pairs + torch.arange(pairs, device=device) - first[owner_sorted]
    send = hidden_states.new_zeros(ep * pairs, width).index_copy(0, slot, hidden_states[order // k])
    send_expert = torch.full((ep * pairs,), local, dtype=expert.dtype, device=device).index_copy(
        0, slot, expert[order] - owner_sorted * local)
    received = all_to_all_single_autograd(send, None, None, layout.group_name)
    received_expert = all_to_all_single(send_expert, None, None, layout.group_name)
    ones = torch.ones(ep * pairs, 1, dtype=top_k_weights.dtype, device=device)
    computed = forward(module, _ScaledGradient.apply(received, float(ep)), received_expert.unsqueeze(-1), ones)
    returned = all_to_all_single_autograd(_ScaledGradient.apply(computed, 1.0 / ep), None, None, layout.group_name)
    outputs = hidden_states.new_zeros(pairs, width).index_copy(0, order, returned.index_select(0, slot))
    weighted = outputs * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, k, width).sum(dim=1).to(hidden_states.dtype)
