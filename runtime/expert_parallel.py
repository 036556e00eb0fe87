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

[Note: experts spread over a tensor-parallel group]
Under tensor parallel every rank of a group holds the same tokens at a mixture-of-experts layer (its copy of
each rank's rows: see [Note: the data contract under tensor parallel]), so no token has to travel: each rank
keeps E / tp of the experts and computes, for every token, the pairs routed to its own experts (the others
are empty slots, ``local``, as above); the layer's output is then the sum of the ranks' shares, a partial sum
like a row-parallel Linear's, and the gradient of its inputs (the tokens and their routing weights) is one too.
Two marker ops say so to the tensor-parallel pass, which inserts the reductions where a consumer needs the
whole value and removes the markers (compiler/propagation/localize.py): ``experts_partial`` on the output,
and ``experts_input`` on the inputs, whose gradient is ``experts_partial``'s. Run eagerly they all-reduce
over the group themselves. The experts' weights and their optimizer state divide by tp, and so does their
compute; what it costs is one all-reduce of the layer's output per layer and direction, as a tensor-parallel
MLP's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dpar.core.torch_internals import all_to_all_single, all_to_all_single_autograd, resolve_process_group


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How one experts module is split: ``num_experts`` over the ``ep_size`` ranks of ``group_name`` (the ep group,
    or the tensor-parallel group where tokens stay put)."""

    num_experts: int
    ep_size: int
    group_name: str
    rank: int = 0  # this rank's place in the group: the block of experts it holds (read where tokens stay put)

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


def _exchanged(
    rows: torch.Tensor, expert: torch.Tensor, layout: ExpertLayout,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``compute(rows, local ids)`` run on the ranks holding each row's ``expert``, its output back in ``rows``'
    order: one (pair) row each, sent in fixed-size buffers (see [Note: routed tokens in fixed-size buffers])."""
    pairs, width = rows.shape
    ep, local = layout.ep_size, layout.local
    owner = torch.div(expert, local, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    owner_sorted = owner[order]
    counts = nn.functional.one_hot(owner, ep).sum(0)
    first = counts.cumsum(0) - counts
    # The slot of each pair (in owner order) in the send buffer: block ``owner``, then its place among them.
    slot = owner_sorted * pairs + torch.arange(pairs, device=rows.device) - first[owner_sorted]
    send = rows.new_zeros(ep * pairs, width).index_copy(0, slot, rows[order])
    send_expert = torch.full((ep * pairs,), local, dtype=expert.dtype, device=rows.device).index_copy(
        0, slot, expert[order] - owner_sorted * local)
    received = all_to_all_single_autograd(send, None, None, layout.group_name)
    received_expert = all_to_all_single(send_expert, None, None, layout.group_name)
    computed = compute(_ScaledGradient.apply(received, float(ep)), received_expert)
    returned = all_to_all_single_autograd(_ScaledGradient.apply(computed, 1.0 / ep), None, None, layout.group_name)
    return rows.new_zeros(pairs, width).index_copy(0, order, returned.index_select(0, slot))


def exchange(
    module: nn.Module, forward: Callable[..., torch.Tensor], layout: ExpertLayout,
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """A routed experts module's output (Hugging Face's convention: every token, its k experts and weights), its
    experts spread over the ep group: ``forward`` runs on each rank's experts with top_k 1 and weight 1, and the
    routing weights apply here, as the module applies them."""
    tokens, width = hidden_states.shape
    k = top_k_index.shape[-1]
    rows = hidden_states.unsqueeze(1).expand(tokens, k, width).reshape(tokens * k, width)

    def compute(received: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(received.shape[0], 1, dtype=top_k_weights.dtype, device=received.device)
        return forward(module, received, expert.unsqueeze(-1), ones)

    outputs = _exchanged(rows, top_k_index.reshape(-1), layout, compute)
    weighted = outputs * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, k, width).sum(dim=1).to(hidden_states.dtype)


def exchange_grouped(
    module: nn.Module, forward: Callable[..., torch.Tensor], layout: ExpertLayout,
    rows: torch.Tensor, tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    """A grouped experts module's output (torchtitan's convention: rows sorted by expert, a count per expert),
    its experts spread over the ep group. Each rank sorts the rows it receives by its local expert, empty slots
    last, and calls ``forward`` with its local counts; a grouped matmul leaves the rows past the last offset
    undefined, so empty slots are zeroed on the way in and replaced by zeros on the way out (both ways of the
    backward too)."""
    return _exchanged(rows, _expert_of_rows(tokens_per_expert, layout, rows), layout, _grouped(module, forward, layout))


def _expert_of_rows(tokens_per_expert: torch.Tensor, layout: ExpertLayout, rows: torch.Tensor) -> torch.Tensor:
    """The expert of each of ``rows``, sorted by expert with ``tokens_per_expert`` each (torchtitan's convention)."""
    experts = torch.arange(layout.num_experts, device=rows.device)
    return torch.repeat_interleave(experts, tokens_per_expert, output_size=rows.shape[0])


def _grouped(
    module: nn.Module, forward: Callable[..., torch.Tensor], layout: ExpertLayout,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A grouped experts module's computation of rows with local expert ids (``local``: an empty slot): sorted by
    expert, empty slots last, zeroed on the way in and replaced by zeros on the way out, since a grouped matmul
    leaves the rows past the last offset undefined (both ways of the backward too)."""

    def compute(received: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        by_expert = torch.argsort(expert, stable=True)
        empty = (expert[by_expert] == layout.local).unsqueeze(-1)
        counts = nn.functional.one_hot(expert, layout.local + 1).sum(0)[:layout.local]
        out = forward(module, received[by_expert].masked_fill(empty, 0.0), counts)
        out = torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)
        return out.new_zeros(out.shape).index_copy(0, by_expert, out)

    return compute


# --- experts spread over a tensor-parallel group: see [Note: experts spread over a tensor-parallel group] ---

@torch.library.custom_op("dpar::experts_partial", mutates_args=())
def experts_partial(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """This rank's experts' share of a value that is the sum of every rank's of ``group_name``: that sum, when run
    eagerly (an all-reduce); in a compiled graph a marker of the partial sum, which the tensor-parallel pass
    reduces where a consumer needs the whole."""
    total = x.clone()
    dist.all_reduce(total, group=resolve_process_group(group_name))
    return total


@experts_partial.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("dpar::experts_input", mutates_args=())
def experts_input(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The identity on a value every rank of ``group_name`` holds whole and alike, read by this rank's experts
    only: its gradient is each rank's share, summed (``experts_partial``). It also ends the gradient of
    ``experts_partial``: what enters this rank's experts' backward must be whole, never a partial sum, since
    their computation is this rank's own and no reduction inside it may mix the ranks'."""
    return x.clone()


@experts_input.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _group_of(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.group_name = inputs[1]


experts_partial.register_autograd(lambda ctx, grad: (experts_input(grad, ctx.group_name), None), setup_context=_group_of)
experts_input.register_autograd(lambda ctx, grad: (experts_partial(grad, ctx.group_name), None), setup_context=_group_of)


def _local_ids(expert: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Each row's expert as an id among this rank's experts; ``local`` (an empty slot) where another rank's."""
    shifted = expert - layout.rank * layout.local
    mine = (shifted >= 0) & (shifted < layout.local)
    return torch.where(mine, shifted, torch.full_like(shifted, layout.local))


def local_experts(
    module: nn.Module, forward: Callable[..., torch.Tensor], layout: ExpertLayout,
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """A routed experts module's output (Hugging Face's convention) from this rank's experts only: a partial sum
    over the tensor-parallel group (see [Note: experts spread over a tensor-parallel group])."""
    group = layout.group_name
    out = forward(module, experts_input(hidden_states, group), _local_ids(top_k_index, layout),
                  experts_input(top_k_weights, group))
    return experts_partial(out, group)


def local_experts_grouped(
    module: nn.Module, forward: Callable[..., torch.Tensor], layout: ExpertLayout,
    rows: torch.Tensor, tokens_per_expert: torch.Tensor,
) -> torch.Tensor:
    """A grouped experts module's output (torchtitan's convention) from this rank's experts only, as
    ``local_experts``."""
    expert = _local_ids(_expert_of_rows(tokens_per_expert, layout, rows), layout)
    out = _grouped(module, forward, layout)(experts_input(rows, layout.group_name), expert)
    return experts_partial(out, layout.group_name)
