"""Bad input on the born-on-meta path: each a named error saying what to do, and the model unchanged.

- Loading into a model ``parallelize`` left on meta (never ``to_empty``): ``dpar.checkpoint.load`` and
  ``load_safetensors`` copied into meta tensors, which does nothing, and returned; now an
  ``UnmaterializedStateError`` before anything is read. torch's ``set_model_state_dict`` there takes its own
  assign path (new tensors from the full state dict), which loads exactly: allowed.
- Another model's checkpoint (DCP or safetensors): ``CheckpointError`` / ``SafetensorsCheckpointError``, unchanged.
- ``to_empty`` before ``parallelize``: no strategy needs the documented order for its numbers; the reverse loads
  the same parameters (it allocates the whole model on every rank first, which the documented order avoids).
- ``to_empty`` onto a device this build cannot use (cuda on a CPU build): torch refuses before moving anything.
- ``dpar.init_weights`` on a model never parallelized is the model's own initializer, as on one device.

One ``run_ranks`` call at 2 ranks (HF Llama and GPT-2, no compile).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import dpar
from distributed import run_ranks


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in (dpar.checkpoint.full_state_dict(model) or {}).items()}


def _meta_left(model: nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).is_meta for p in model.parameters())


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _init_rotary(model: nn.Module) -> None:
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__:
            model.inner._init_weights(module)


def _cases(rank: int, world_size: int, root: str) -> dict:
    import third_party as tp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    example = tp.rank_slice(tp.global_batch(0, tp.ROWS_PER_RANK * world_size), rank, world_size)
    full = {k: v.detach().clone() for k, v in tp.build("llama").state_dict().items()}

    def meta_model(strategy: str, name: str = "llama") -> nn.Module:
        torch._dynamo.reset()
        with torch.device("meta"):
            model = tp.build(name)
        dpar.parallelize(model, strategy=strategy, example_inputs=example)
        return model

    saved = tp.build("llama")
    dpar.parallelize(saved, strategy="fsdp", example_inputs=example)
    dpar.checkpoint.save(saved, None, os.path.join(root, "llama"))
    dpar.checkpoint.save_safetensors(saved, os.path.join(root, "llama_hf"), prefix="inner.")
    found: dict = {}
    for strategy in ("fsdp", "tp"):
        # Still on meta: refused by name, before anything is read; the model stays as it was.
        for how, load in (
            ("dpar.checkpoint.load", lambda m: dpar.checkpoint.load(m, None, os.path.join(root, "llama"))),
            ("load_safetensors", lambda m: dpar.checkpoint.load_safetensors(m, os.path.join(root, "llama_hf"), prefix="inner.")),
        ):
            model = meta_model(strategy)
            try:
                load(model)
                found[f"{strategy} meta {how}"] = "loaded nothing, silently"
            except dpar.UnmaterializedStateError as error:
                found[f"{strategy} meta {how}"] = (str(error), _meta_left(model) == len(list(model.parameters())))
        # torch's own path into meta parameters assigns new ones: exact.
        model = meta_model(strategy)
        set_model_state_dict(model, dict(full) if rank == 0 else {}, options=broadcast)
        loaded = _full(model)
        found[f"{strategy} meta set_model_state_dict"] = (_meta_left(model), _equal(loaded, full) if rank == 0 else True)

        # Another model's checkpoint: named, nothing loaded.
        model = tp.build("gpt2")
        dpar.parallelize(model, strategy=strategy, example_inputs=example)
        before = _full(model)
        for how, load, error_class in (
            ("dcp", lambda m: dpar.checkpoint.load(m, None, os.path.join(root, "llama")), dpar.CheckpointError),
            ("safetensors", lambda m: dpar.checkpoint.load_safetensors(m, os.path.join(root, "llama_hf"), prefix="inner."),
             dpar.SafetensorsCheckpointError),
        ):
            try:
                load(model)
                found[f"{strategy} other model {how}"] = "loaded"
            except error_class as error:
                after = _full(model)  # every rank gathers
                found[f"{strategy} other model {how}"] = (str(error), _equal(before, after) if rank == 0 else True)

    # to_empty before parallelize: the same parameters as the documented order.
    for strategy in ("fsdp", "zero2", "tp", "zero1"):
        loaded = []
        for reverse in (False, True):
            torch._dynamo.reset()
            with torch.device("meta"):
                model = tp.build("llama")
            if reverse:
                model.to_empty(device="cpu")
                _init_rotary(model)
            dpar.parallelize(model, strategy=strategy, example_inputs=example)
            if not reverse:
                model.to_empty(device="cpu")
                _init_rotary(model)
            set_model_state_dict(model, dict(full) if rank == 0 else {}, options=broadcast)
            loaded.append(_full(model))
        found[f"{strategy} to_empty first"] = _equal(loaded[0], full) and _equal(loaded[1], full) if rank == 0 else True

    # A device this build has no backend for: torch refuses before moving a parameter; cpu still works.
    if not torch.cuda.is_available():
        model = meta_model("fsdp")
        try:
            model.to_empty(device="cuda")
            found["to_empty cuda"] = "moved"
        except (AssertionError, RuntimeError) as error:
            all_meta = _meta_left(model) == len(list(model.parameters()))
            model.to_empty(device="cpu")
            found["to_empty cuda"] = (type(error).__name__, all_meta, _meta_left(model))

    # init_weights on a model never parallelized (a process group exists): the model's own init.
    found["init_weights never parallelized"] = _init_weights_is_one_device() if rank == 0 else True
    return found


@torch.no_grad()
def _init_weights_is_one_device() -> bool:
    import third_party as tp
    from transformers.initialization import guard_torch_init_functions

    want = tp.build("llama")
    torch.manual_seed(3)
    with guard_torch_init_functions():
        want.inner.apply(want.inner._init_weights)
    got = tp.build("llama")
    torch.manual_seed(3)
    dpar.init_weights(got)
    return _equal(want.state_dict(), got.state_dict())


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> dict:
    result = run_ranks(_cases, 2, str(tmp_path_factory.mktemp("bad_input")), timeout_s=300)[0]
    for label, value in result.items():
        print(f"bad input: {label}: {value}")
    return result


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
@pytest.mark.parametrize("how", ["dpar.checkpoint.load", "load_safetensors"])
def test_loading_into_a_model_still_on_meta_is_refused_by_name(found: dict, strategy: str, how: str) -> None:
    message, unchanged = found[f"{strategy} meta {how}"]
    assert f"{how} into a model still on the meta device" in message and "model.to_empty(device=...)" in message
    assert unchanged


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_set_model_state_dict_into_meta_parameters_assigns_them_exactly(found: dict, strategy: str) -> None:
    assert found[f"{strategy} meta set_model_state_dict"] == (0, True)


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
@pytest.mark.parametrize("how", ["dcp", "safetensors"])
def test_another_models_checkpoint_is_refused_by_name_and_nothing_loaded(found: dict, strategy: str, how: str) -> None:
    message, unchanged = found[f"{strategy} other model {how}"]
    assert "model.embed_tokens.weight" in message and "not in th" in message, message  # names the tensors
    assert unchanged


@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "tp", "zero1"])
def test_to_empty_before_parallelize_loads_the_same_parameters(found: dict, strategy: str) -> None:
    assert found[f"{strategy} to_empty first"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU build has no cuda to refuse")
def test_to_empty_onto_a_device_without_backend_moves_nothing(found: dict) -> None:
    _, all_meta, meta_after_cpu = found["to_empty cuda"]
    assert all_meta and meta_after_cpu == 0


def test_init_weights_on_a_model_never_parallelized_is_its_own_init(found: dict) -> None:
    assert found["init_weights never parallelized"]


def test_init_weights_without_a_process_group_is_its_own_init() -> None:
    assert _init_weights_is_one_device()
