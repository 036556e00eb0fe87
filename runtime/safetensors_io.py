"""Hugging Face safetensors checkpoints in and out of a parallelized model, one shard file at a time.

[Note: reading only this rank's block]
``model.state_dict()`` of a parallelized model holds, for each parameter a strategy splits (fsdp/zero2's
``Shard(0)``, tensor parallel's column or row blocks, both under fsdp+tp), a DTensor of the parameter's
global shape whose local part is this rank's block (see [Note: a split parameter in a state dict] in
``tensor_parallel.py``), and for a replicated one the full tensor itself. The DTensor's mesh coordinate and
placements say which rows and columns the block is (``compute_local_shape_and_global_offset``: torch.chunk's
uneven blocks, nested shards read left to right), so each rank asks safetensors for that rectangle alone
(``safe_open(...).get_slice(name)[rows, cols]``, which reads those bytes of the memory-mapped file) and copies
it into its block in place. No rank holds a full copy of a split parameter, and no collective runs, except
one exchange of each rank's verdict on the files before anything is written (nothing half-loaded, on any
rank). A model whose state dict a hook rebuilds (tensors that are not its parameters' storage) gets the
loaded values through ``load_state_dict`` as well, as ``dpar.checkpoint.load`` does.

[Note: names and tied weights]
A Hugging Face checkpoint names tensors as the Hugging Face module does (``model.layers.0.mlp.up_proj.weight``).
A model that wraps it (``self.inner = LlamaForCausalLM(...)``) names them ``inner.model.layers...``: pass
``prefix="inner."`` (entries outside the prefix are neither read nor written), or ``key_map``, a function from
a state-dict name to the file's name (``None``: not in the file). A weight tied to another (an LM head tied
to the token embedding) is one parameter under two names; Hugging Face writes it once, under one of them.
Both loading and saving here treat the names of one parameter as one entry: loaded from whichever name the
file holds, written once under its first name in the state dict (the embedding's, as Hugging Face does).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard

from dpar.core.errors import DparError, OptionsError, SafetensorsCheckpointError
from dpar.core.model_state import local_part
from dpar.core.torch_internals import compute_local_shape_and_global_offset

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
KeyMap = Callable[[str], str | None]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class _Entry:
    """One parameter or buffer: every state-dict name it has (several when tied), the file names they map to,
    and its state-dict value (a DTensor of the global shape, or the full tensor)."""

    names: list[str]
    file_names: list[str]
    value: torch.Tensor


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def _mapper(prefix: str, key_map: KeyMap | None) -> KeyMap:
    if key_map is not None and prefix:
        raise OptionsError("pass prefix= or key_map=, not both (a key_map can strip the prefix itself)")
    if key_map is not None:
        return key_map
    return lambda name: name[len(prefix):] if name.startswith(prefix) else None


def _entries(module: nn.Module, to_file: KeyMap) -> list[_Entry]:
    """The state dict's tensors grouped by the parameter or buffer they are (tied names: one entry)."""
    owner = {name: id(t) for name, t in module.named_parameters(remove_duplicate=False)}
    owner.update({name: id(t) for name, t in module.named_buffers(remove_duplicate=False)})
    by_owner: dict[int, _Entry] = {}
    for name, value in module.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue  # extra state: not a tensor a safetensors file holds
        file_name = to_file(name)
        if file_name is None:
            continue
        key = owner.get(name, id(value))
        if key in by_owner:
            by_owner[key].names.append(name)
            by_owner[key].file_names.append(file_name)
        else:
            by_owner[key] = _Entry([name], [file_name], value)
    return list(by_owner.values())


# [Note: safetensors and a pipelined model]
# Under ``dpar.pipeline`` each rank's ``model.state_dict()`` holds its stages' tensors only (DTensors of this rank's
# rows under dp_strategy="fsdp"; see [Note: a pipelined model's state] in ``api/pipelining.py``). Loading reads
# those as for any model, and the file's tensors of other ranks' stages are theirs, not "unexpected". Saving
# walks the whole model's entries in state-dict order (tied names once), each gathered from the rank holding it.


def _pipeline_entries(module: nn.Module, to_file: KeyMap) -> list[_Entry]:
    """The whole pipelined model's entries (every rank's stages), each value a meta tensor of its shape and dtype."""
    pipelined = module._dpar_pipeline
    first = pipelined.first_names()
    by_first: dict[str, _Entry] = {}
    for name, (shape, dtype) in pipelined.whole_model().items():
        file_name = to_file(name)
        if file_name is None:
            continue
        key = first.get(name, name)
        if key in by_first:
            by_first[key].names.append(name)
            by_first[key].file_names.append(file_name)
        else:
            by_first[key] = _Entry([name], [file_name], torch.empty(shape, dtype=dtype, device="meta"))
    return list(by_first.values())


def _held_elsewhere(module: nn.Module, to_file: KeyMap) -> set[str]:
    """The file names of the tensors another pipeline rank's stages hold (none unless ``module`` is pipelined)."""
    pipelined = getattr(module, "_dpar_pipeline", None)
    if pipelined is None:
        return set()
    return {f for name in pipelined.released() if (f := to_file(name)) is not None}


def _block_of(value: torch.Tensor) -> tuple[slice, ...] | None:
    """The rows/columns (one slice per dim) of the global tensor that this rank's part of ``value`` is;
    None: the whole tensor (a plain tensor, or a DTensor replicated on every mesh dimension)."""
    if not isinstance(value, DTensor) or all(isinstance(p, Replicate) for p in value.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def _layout_problem(value: torch.Tensor) -> str | None:
    if not isinstance(value, DTensor):
        return None
    odd = [p for p in value.placements if type(p) not in (Shard, Replicate)]
    if odd:
        return f"its placements {tuple(value.placements)} are not Shard/Replicate blocks"
    block = _block_of(value)
    if block is not None and tuple(s.stop - s.start for s in block) != tuple(value.to_local().shape):
        return f"its local part {tuple(value.to_local().shape)} is not the block {block} its placements name"
    return None


class _Source:
    """The checkpoint's files, opened (memory-mapped) once: which file holds each tensor, its shape and dtype."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        path = os.fspath(directory)
        self.directory = path
        if os.path.isfile(path):
            files, index_map = [path], None
        elif os.path.isfile(os.path.join(path, INDEX)):
            index_path = os.path.join(path, INDEX)
            try:
                with open(index_path) as f:
                    index_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise SafetensorsCheckpointError(
                    f"{index_path} is not a readable safetensors index ({type(exc).__name__}: {exc}); it must be "
                    'JSON with a "weight_map" from tensor name to shard file: save the checkpoint again'
                ) from exc
            names = sorted(set(index_map.values()))
            absent = [n for n in names if not os.path.isfile(os.path.join(path, n))]
            if absent:
                raise SafetensorsCheckpointError(
                    f"{index_path} names shard file(s) absent from {path}: {', '.join(absent)} (they hold "
                    f"{sum(v in absent for v in index_map.values())} tensors, e.g. "
                    f"{next(k for k, v in index_map.items() if v in absent)}); copy the whole checkpoint directory"
                )
            files = [os.path.join(path, n) for n in names]
        elif os.path.isfile(os.path.join(path, SINGLE)):
            files, index_map = [os.path.join(path, SINGLE)], None
        else:
            raise SafetensorsCheckpointError(
                f"{path} holds neither {INDEX} (sharded) nor {SINGLE}: pass the directory save_pretrained or "
                "dpar.checkpoint.save_safetensors wrote, or the path of one .safetensors file"
            )
        self.handles: dict[str, Any] = {}
        self.file_of: dict[str, str] = {}  # tensor name -> file path
        for file in files:
            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as exc:  # safetensors' own error for a damaged header or a short file
                raise SafetensorsCheckpointError(
                    f"{file} is not a readable safetensors file ({type(exc).__name__}: {exc}); copy it again"
                ) from exc
            self.handles[file] = handle
            for name in handle.keys():
                self.file_of.setdefault(name, file)
        if index_map is not None:
            misplaced = [
                f"{name} (in {file})" for name, file in index_map.items()
                if self.file_of.get(name) != os.path.join(path, file)
            ]
            if misplaced:
                raise SafetensorsCheckpointError(
                    f"{os.path.join(path, INDEX)} places tensors in shard files that do not hold them: "
                    f"{_listed(misplaced)}; the index and the shards come from different saves: save again"
                )

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        tensor = self.handles[self.file_of[name]].get_slice(name)
        return tuple(tensor.get_shape()), tensor.get_dtype()

    def read(self, name: str, block: tuple[slice, ...] | None) -> torch.Tensor:
        handle = self.handles[self.file_of[name]]
        if block is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[block]


def _listed(items: list[str], shown: int = 4) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _agree(error: DparError | None) -> None:
    """Raise on every rank if any rank refused (each validates its own view of the files): its own error, or
    the first refusing rank's message."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, None if error is None else f"{type(error).__name__}: {error}")
        failed = [(rank, v) for rank, v in enumerate(verdicts) if v is not None]
        if error is None and failed:
            rank, first = failed[0]
            raise SafetensorsCheckpointError(f"rank {rank} refused to load, so nothing was loaded on any rank: {first}")
    if error is not None:
        raise error


def load_safetensors(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    prefix: str = "",
    key_map: KeyMap | None = None,
    strict: bool = True,
    cast: bool = False,
) -> None:
    """Read a Hugging Face safetensors checkpoint into ``model`` in place, each rank reading its own blocks only.

    ``directory``: what ``save_pretrained`` writes (``model.safetensors.index.json`` and its shard files, or one
    ``model.safetensors``), or the path of one ``.safetensors`` file. Call it on every rank, after
    ``dpar.parallelize`` (or on a plain model); a model made with ``to_empty`` loads the same way. ``prefix``:
    where the Hugging Face module sits in ``model`` (``"inner."`` for ``self.inner = LlamaForCausalLM(...)``);
    or ``key_map(state_dict_name) -> file name or None``. See [Note: names and tied weights].

    Every check runs before any tensor is written, on every rank: a shard file the index names is absent, a
    tensor of the model is not in the files (``strict``) or a tensor of the files not in the model (``strict``),
    a shape differs, or a dtype does (unless ``cast=True``, which converts to the model's dtype as it copies).
    Each raises ``dpar.SafetensorsCheckpointError`` naming the file and the tensor, and the model is unchanged.
    """
    module = _unwrap(model)
    if getattr(module, "_dpar_pipeline", None) is not None:
        module._dpar_pipeline.retie()  # to_empty untied a tied weight: one entry again (see api/pipelining.py)
    error, plan = None, []
    try:
        to_file = _mapper(prefix, key_map)
        entries = _entries(module, to_file)
        source = _Source(directory)
        plan = _validated(entries, source, strict, cast, _held_elsewhere(module, to_file))
    except DparError as exc:
        error = exc
    _agree(error)
    aliases = _storages(module)
    rebuilt = False
    with torch.no_grad():
        for entry, file_name in plan:
            local = local_part(entry.value)
            if local.numel():
                local.copy_(source.read(file_name, _block_of(entry.value)))
                rebuilt = rebuilt or local.untyped_storage().data_ptr() not in aliases
    if rebuilt:  # a state-dict hook built new tensors: hand them to the module (see the module's Note)
        module.load_state_dict({n: e.value for e, _ in plan for n in e.names}, strict=False)


def _storages(module: nn.Module) -> set[int]:
    tensors = list(module.parameters()) + list(module.buffers())
    return {local_part(t).untyped_storage().data_ptr() for t in tensors}


def _validated(
    entries: list[_Entry], source: _Source, strict: bool, cast: bool, elsewhere: set[str] | None = None
) -> list[tuple[_Entry, str]]:
    """(entry, the file's name for it) for each entry to load; raises naming every problem found. ``elsewhere``:
    file names another pipeline rank loads (see [Note: safetensors and a pipelined model])."""
    plan, missing, wrong, claimed = [], [], [], set(elsewhere or ())
    for entry in entries:
        present = [n for n in entry.file_names if n in source.file_of]
        claimed.update(present)
        if not present:
            missing.append(" = ".join(entry.file_names))
            continue
        name = present[0]
        file = source.file_of[name]
        shape, dtype = source.shape_and_dtype(name)
        mine = entry.value
        if shape != tuple(mine.shape):
            wrong.append(f"{name} in {file} has shape {list(shape)}, the model's {entry.names[0]} {list(mine.shape)}")
            continue
        if _DTYPES.get(dtype) != mine.dtype and not cast:
            wrong.append(
                f"{name} in {file} is {dtype} ({_DTYPES.get(dtype)}), the model's {entry.names[0]} is {mine.dtype} "
                "(pass cast=True to convert it as it loads, or build the model in that dtype)"
            )
            continue
        layout = _layout_problem(mine)
        if layout is not None:
            raise OptionsError(f"{entry.names[0]} cannot be read block by block: {layout}")
        plan.append((entry, name))
    unexpected = sorted(set(source.file_of) - claimed)
    problems = []
    if wrong:
        problems.append(f"shapes or dtypes differ: {_listed(wrong)}")
    if strict and missing:
        problems.append(f"not in the checkpoint: {_listed(missing)}")
    if strict and unexpected:
        problems.append(
            f"in the checkpoint but not in the model: {_listed([f'{n} (in {source.file_of[n]})' for n in unexpected])}"
        )
    if problems:
        hint = "check prefix=/key_map= and the model's configuration"
        wrapper = _wrapper_prefix(missing, unexpected)
        if wrapper:
            hint = f"the model's names are the file's under {wrapper!r}: pass prefix={wrapper!r}"
        if strict and (missing or unexpected):
            hint += "; strict=False loads the tensors both hold and leaves the rest"
        raise SafetensorsCheckpointError(
            f"the safetensors checkpoint at {source.directory} does not fit this model, nothing was loaded; "
            f"{'; '.join(problems)}. Fix: {hint}"
        )
    return plan


def _wrapper_prefix(missing: list[str], unexpected: list[str]) -> str | None:
    """The module path the file's names sit under in this model, when that explains a missing name."""
    names = set(unexpected)
    for name in missing:
        for cut in range(1, len(name)):
            if name[cut - 1] == "." and name[cut:] in names:
                return name[:cut]
    return None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if match is None:
        raise OptionsError(f"max_shard_size={size!r}: give bytes (an int) or a size like '5GB', '500MB', '2GiB'")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])


def _shards(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Entries in state-dict order, cut into files of at most ``limit`` bytes (a bigger tensor: a file of its own)."""
    shards: list[list[_Entry]] = [[]]
    filled = 0
    for entry in entries:
        size = entry.value.numel() * entry.value.element_size()
        if shards[-1] and filled + size > limit:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += size
    return [s for s in shards if s]


def save_safetensors(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    prefix: str = "",
    key_map: KeyMap | None = None,
    config: Any = None,
) -> None:
    """Export ``model`` as a Hugging Face safetensors checkpoint that ``from_pretrained(directory)`` opens.

    Call it on every rank, under any strategy: each tensor is gathered whole (``full_tensor``), one at a time,
    and rank 0 writes shard files of at most ``max_shard_size`` (bytes, or ``"5GB"``-style) as they fill, so
    it holds one file's worth at most. Several files get ``model.safetensors.index.json`` (``weight_map``,
    ``metadata.total_size``), one is ``model.safetensors``, as ``save_pretrained`` writes them; earlier
    ``model*.safetensors`` files in ``directory`` are removed first. Names as in ``load_safetensors``
    (``prefix``/``key_map``); a tied weight is written once. ``config``: an object with ``save_pretrained``
    (a ``transformers`` config) written beside the weights. Raises on every rank if rank 0 could not write.
    """
    module = _unwrap(model)
    path = os.fspath(directory)
    pipelined = getattr(module, "_dpar_pipeline", None)
    if pipelined is not None:  # [Note: safetensors and a pipelined model]
        entries, local = _pipeline_entries(module, _mapper(prefix, key_map)), module.state_dict()
    else:
        entries = _entries(module, _mapper(prefix, key_map))
    shards = _shards(entries, _bytes(max_shard_size))
    writer = not dist.is_initialized() or dist.get_rank() == 0
    files = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    failure: str | None = None

    def attempt(step: Callable[[], None]) -> None:
        nonlocal failure
        if writer and failure is None:
            try:
                step()
            except Exception as exc:  # keep gathering with the other ranks, then raise on all of them
                failure = f"{type(exc).__name__}: {exc}"

    attempt(lambda: _clear(path))
    weight_map: dict[str, str] = {}
    total = 0
    for file, shard in zip(files, shards):
        tensors: dict[str, torch.Tensor] = {}
        for entry in shard:
            value = entry.value.detach()
            if pipelined is not None:  # from the rank whose stage holds it
                full = pipelined.full_tensor(entry.names[0], local)
            else:
                full = value.full_tensor() if isinstance(value, DTensor) else value  # collective: every rank
            if writer:
                tensors[entry.file_names[0]] = full.to("cpu", copy=True).contiguous()
                weight_map[entry.file_names[0]] = file
                total += full.numel() * full.element_size()
        attempt(lambda: save_file(tensors, os.path.join(path, file), metadata={"format": "pt"}))
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        attempt(lambda: _write_json(os.path.join(path, INDEX), index))
    if config is not None:
        attempt(lambda: config.save_pretrained(path))
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdict = [failure]
        dist.broadcast_object_list(verdict, src=0)
        failure = verdict[0]
    if failure is not None:
        raise SafetensorsCheckpointError(f"rank 0 could not write the safetensors checkpoint at {path}: {failure}")


def _clear(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name == INDEX or (name.startswith("model") and name.endswith(".safetensors")):
            os.remove(os.path.join(path, name))


def _write_json(path: str, value: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


__all__ = ["load_safetensors", "save_safetensors"]
