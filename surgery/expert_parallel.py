"""Expert parallel's surgery: each routed experts module keeps its rank's experts, and its forward exchanges tokens.

An experts module is what a mixture-of-experts layer calls with the router's choice: it has ``num_experts`` and
weights of shape ``(num_experts, ...)``, and its forward takes either ``(hidden_states, top_k_index, top_k_weights)``
(Hugging Face's experts: ``gate_up_proj``, ``down_proj``) or ``(rows sorted by expert, tokens per expert)``
(torchtitan's ``GroupedExperts``: ``w1``, ``w2``, ``w3``). Each weight becomes this rank's block of experts along dim 0 (a
split parameter like tensor parallel's, so state dicts, writes and initializers treat it alike: see
surgery/tensor_parallel.py), and the module's forward becomes runtime/expert_parallel.py's exchange around its own.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dpar.core.errors import OptionsError
from dpar.runtime.expert_parallel import (
    ExpertLayout, exchange, exchange_grouped, local_experts, local_experts_grouped,
)
from dpar.surgery import tensor_parallel

# The experts module's calling conventions, by the number of arguments its forward takes.
ROUTED = 3  # Hugging Face's: hidden_states, top_k_index, top_k_weights
GROUPED = 2  # torchtitan's GroupedExperts: rows sorted by expert, tokens per expert


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's routed experts modules by name (see the module docstring for what one is)."""
    found = {}
    for name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        own = list(module.parameters(recurse=False))
        if not isinstance(count, int) or isinstance(count, bool) or not own:
            continue
        if not all(p.ndim >= 2 and p.shape[0] == count for p in own) or not any(p.ndim >= 3 for p in own):
            continue
        if _convention(module) in (ROUTED, GROUPED):
            found[name] = module
    return found


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """What ``split_experts`` did: each experts module's split weights, and the forward that exchanges its tokens
    (for ``tensor_parallel.install_markers``, after any sharding of the blocks over "dp")."""

    splits: tensor_parallel.Splits
    forwards: dict[nn.Module, Callable[..., Any]]

    def parameter_names(self) -> list[str]:
        return [spec.name for specs in self.splits.values() for spec in specs.values()]

    def install(self, model: nn.Module, state_dict_mesh: DeviceMesh) -> None:
        tensor_parallel.install_markers(model, self.splits, state_dict_mesh, self.forwards)


def split_experts(model: nn.Module, ep_mesh: DeviceMesh) -> ExpertSplit:
    """Keep this rank's experts of every experts module (rank 0's values), and build each module's forward that
    exchanges tokens over ``ep_mesh``; refuses a model with no experts module, or experts the ep degree does not
    divide."""
    found = experts_modules(model)
    ep = ep_mesh.size()
    if not found:
        listed = next((name for name, module in model.named_modules()
                       if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts"), None)
        kind = (f"; {listed} is an nn.ModuleList of {len(model.get_submodule(listed))} expert modules, which its MoE "
                "layer loops over itself, so no rank can hold only some of them: store them stacked, as one module's "
                "(num_experts, ...) weights in either convention (Hugging Face's since transformers 5)"
                if listed is not None else ". For a dense model choose a strategy without 'ep' (ddp, fsdp, ...)")
        raise OptionsError(
            f"expert parallelism spreads routed experts over the 'ep' axis, but {type(model).__name__} has no experts "
            "module: a module with num_experts, weights of shape (num_experts, ...) and forward(hidden_states, "
            "top_k_index, top_k_weights) (Hugging Face's) or forward(rows sorted by expert, tokens per expert) "
            f"(torchtitan's GroupedExperts){kind}"
        )
    for name, module in found.items():
        if module.num_experts % ep:
            raise OptionsError(
                f"{name} has {module.num_experts} experts, which {ep} ranks of the 'ep' axis cannot hold in equal "
                f"numbers; choose an ep degree that divides {module.num_experts}"
            )
    group = ep_mesh.get_group()
    dims = {f"{name}.{p}": 0 for name, module in found.items() for p, _ in module.named_parameters(recurse=False)}
    splits = tensor_parallel.split_parameters(model, dims, group)
    forwards = {module: _split_forward(module, ExpertLayout(module.num_experts, ep, group.group_name),
                                       exchange, exchange_grouped) for module in found.values()}
    return ExpertSplit({m: s for m, s in splits.items() if m in forwards}, forwards)


def experts_by_expert(found: dict[str, nn.Module], tp_dims: dict[str, int | None], tp: int) -> dict[str, int | None]:
    """``tp_dims`` (the automatic tensor-parallel plan) with every experts module (``found`` by ``experts_modules``)
    whose count ``tp`` divides split by expert, dim 0 of each of its weights (see [Note: experts spread over a
    tensor-parallel group])."""
    spread = {f"{name}.{p}": 0 for name, module in found.items() if module.num_experts % tp == 0
              for p, _ in module.named_parameters(recurse=False)}
    return {**tp_dims, **spread}


def local_expert_forwards(found: dict[str, nn.Module], splits: tensor_parallel.Splits, tp_group: str, tp: int,
                          rank: int) -> dict[nn.Module, Callable[..., Any]]:
    """The forward of each experts module (``found`` by ``experts_modules`` before the split) that a tensor-parallel
    split divides by expert: this rank's experts on every token, a partial sum over ``tp_group``. Its weights split
    otherwise, or only some of them, is refused by name."""
    forwards = {}
    for name, module in found.items():
        specs = splits.get(module, {})
        dims = {p: specs[p].dim if p in specs else None for p, _ in module.named_parameters(recurse=False)}
        if all(d is None for d in dims.values()):
            continue  # replicated over tp: every rank computes every expert
        if any(d != 0 for d in dims.values()):
            raise OptionsError(
                f"tensor parallel splits the experts of {name} as {{{_dims_shown(name, dims)}}}; an experts module is "
                f"split by expert, dim 0 of every weight (tp_plan={{{_dims_shown(name, dict.fromkeys(dims, 0))}, ...}}), "
                "or kept whole (None for each)"
            )
        forwards[module] = _split_forward(module, ExpertLayout(module.num_experts, tp, tp_group, rank),
                                          local_experts, local_experts_grouped)
    return forwards


def _dims_shown(name: str, dims: dict[str, int | None]) -> str:
    return ", ".join(f"'{name}.{p}': {d}" for p, d in dims.items())


def _convention(module: nn.Module) -> int:
    arguments = [p for p in inspect.signature(type(module).forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(arguments) - 1


def _split_forward(
    module: nn.Module, layout: ExpertLayout, routed: Callable[..., Any], grouped: Callable[..., Any],
) -> Callable[..., Any]:
    """The experts module's forward over ``layout``: its own ``forward`` inside runtime's ``routed`` or ``grouped``
    (by the module's convention). Hugging Face's forward counts its experts, so it is given its local count (an id
    of ``local`` is an empty slot); torchtitan's reads no count (its MoE sizes buffers by num_experts: left whole)."""
    forward = type(module).forward
    run = routed if _convention(module) == ROUTED else grouped
    if run is routed:
        module.num_experts = layout.local
        module._is_expert_parallel = True

    def split_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return run(module, forward, layout, *args, **kwargs)

    return split_forward
