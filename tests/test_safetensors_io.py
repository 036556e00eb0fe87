"""Hugging Face safetensors checkpoints in and out: ``dpar.checkpoint.load_safetensors`` / ``save_safetensors``.

A Hugging Face Llama (tests/third_party.py, wrapped as ``inner.``) is saved by ``save_pretrained`` in several shard
files with an index. One ``run_ranks`` call on 2 gloo ranks loads it into dpar models under ddp, fsdp, tp, fsdp+tp
((1, 2) mesh) and zero2: every parameter must equal the file's exactly, each rank must have read exactly its own
block of each tensor (a recording ``safe_open``), fsdp and tp then train 5 AdamW steps to torch DDP's parameters
from the same file, and their export opens with ``transformers.AutoModelForCausalLM.from_pretrained`` with the
same tensors. GPT-2 (LM head tied to the token embedding, written once) loads and exports under tp the same way.
Bad checkpoints (a shard file absent, a tensor renamed, another shape, another dtype) raise
``dpar.SafetensorsCheckpointError`` naming the file and tensor, and leave the model as it was.
"""

from __future__ import annotations

import json
import os
import shutil

import importlib.util

import pytest
import torch
import torch.nn as nn

from distributed import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

LR, STEPS, SHARD = 1e-3, 5, "40KB"
STRATEGIES = {"ddp": None, "fsdp": None, "tp": None, "fsdp+tp": (1, 2), "zero2": None}
TRAINED = ("fsdp", "tp", "fsdp+tp")
HAS_TITAN = importlib.util.find_spec("torchtitan") is not None


def source_model(name: str) -> nn.Module:
    """The third-party model with weights unlike a fresh build's (so a load that did nothing shows)."""
    import third_party

    model = third_party.build(name)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


ODD_SPLITS = {"0.weight": 0, "1.weight": 0, "1.bias": 0, "3.weight": 1, "3.bias": None}


def odd_model(seed: int) -> nn.Module:
    """Dimensions 2 ranks split unevenly (torch.chunk's 51/50 and 19/18 blocks) under fsdp and tp."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(101, 48), nn.Linear(48, 37), nn.ReLU(), nn.Linear(37, 48))


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    from third_party import ROWS_PER_RANK, global_batch, rank_slice

    return rank_slice(global_batch(step, ROWS_PER_RANK * world_size), rank, world_size)


class Recorder:
    """Wraps safetensors' ``safe_open``: records how many elements of each tensor a rank read."""

    def __init__(self, real) -> None:
        self.real, self.read = real, {}

    def __call__(self, *args, **kwargs):
        recorder, handle = self, self.real(*args, **kwargs)

        class Slice:
            def __init__(self, name: str) -> None:
                self.name, self.inner = name, handle.get_slice(name)

            def get_shape(self):
                return self.inner.get_shape()

            def get_dtype(self):
                return self.inner.get_dtype()

            def __getitem__(self, index):
                block = self.inner[index]
                recorder.read[self.name] = recorder.read.get(self.name, 0) + block.numel()
                return block

        class Handle:
            def keys(self):
                return handle.keys()

            def get_slice(self, name: str):
                return Slice(name)

            def get_tensor(self, name: str):
                tensor = handle.get_tensor(name)
                recorder.read[name] = recorder.read.get(name, 0) + tensor.numel()
                return tensor

        return Handle()


def train(model: nn.Module, runner: nn.Module, rank: int, world_size: int) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        runner(*batch(step, rank, world_size)).backward()
        optimizer.step()


def parallelized(name: str, strategy: str, rank: int, world_size: int) -> nn.Module:
    import dpar
    import third_party
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = third_party.build(name)
    kwargs = {}
    if STRATEGIES.get(strategy):
        kwargs["mesh"] = init_device_mesh("cpu", STRATEGIES[strategy], mesh_dim_names=("dp", "tp"))
    return dpar.parallelize(model, strategy=strategy, example_inputs=batch(0, rank, world_size), **kwargs)


def local_sizes(model: nn.Module) -> dict[str, int]:
    """File name -> elements of this rank's part of it (its block, or the whole tensor where replicated)."""
    from torch.distributed.tensor import DTensor

    seen, sizes = set(), {}
    for name, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.untyped_storage().data_ptr() in seen:
            continue  # a tied weight: read once
        seen.add(local.untyped_storage().data_ptr())
        sizes[name.removeprefix("inner.")] = local.numel()
    return sizes


def exported(model: nn.Module, directory: str, rank: int) -> dict | None:
    """``save_safetensors`` of ``model``, opened by ``from_pretrained`` on rank 0: (its state dict, the model's)."""
    import dpar
    import transformers as tf

    dpar.checkpoint.save_safetensors(
        model, directory, prefix="inner.", max_shard_size=SHARD, config=model.inner.config
    )
    full = dpar.checkpoint.full_state_dict(model)
    if rank != 0:
        return None
    opened = tf.AutoModelForCausalLM.from_pretrained(directory)
    return {
        "files": sorted(os.listdir(directory)),
        "opened": {k: v.detach().clone() for k, v in opened.state_dict().items()},
        "model": {k.removeprefix("inner."): v for k, v in full.items()},
    }


def on_two_ranks(rank: int, world_size: int, sources: dict[str, str], bad: str, out: str) -> dict:
    import dpar
    import third_party
    import torch.distributed as dist
    from dpar.runtime import safetensors_io

    results: dict = {"loaded": {}, "read": {}, "local": {}, "trained": {}, "exported": {}}
    recorder = Recorder(safetensors_io.safe_open)
    safetensors_io.safe_open = recorder
    # torch DDP from the file: the anchor.
    reference = third_party.build("llama")
    dpar.checkpoint.load_safetensors(reference, sources["llama"], prefix="inner.")
    train(reference, nn.parallel.DistributedDataParallel(reference), rank, world_size)
    results["ddp_reference"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    for strategy in STRATEGIES:
        model = parallelized("llama", strategy, rank, world_size)
        recorder.read = {}
        dpar.checkpoint.load_safetensors(model, sources["llama"], prefix="inner.")
        results["read"][strategy], results["local"][strategy] = recorder.read, local_sizes(model)
        results["loaded"][strategy] = dpar.checkpoint.full_state_dict(model)
        if strategy == "fsdp":  # a bad file refused on both ranks, the model untouched
            try:
                dpar.checkpoint.load_safetensors(model, bad, prefix="inner.")
                results["bad_fsdp"] = "loaded"
            except dpar.SafetensorsCheckpointError as exc:
                results["bad_fsdp"] = str(exc)
            results["after_bad_fsdp"] = dpar.checkpoint.full_state_dict(model)
        if strategy in TRAINED:
            train(model, torch.compile(model, backend="dpar", options={"compiler": "aot_eager"}), rank, world_size)
            results["trained"][strategy] = dpar.checkpoint.full_state_dict(model)
            results["exported"][strategy] = exported(model, os.path.join(out, strategy.replace("+", "_")), rank)
        dist.barrier()
    for strategy in ("fsdp", "tp"):  # uneven blocks
        plan = {"tp_plan": ODD_SPLITS} if strategy == "tp" else {}
        model = dpar.parallelize(odd_model(seed=0), strategy=strategy, **plan)
        recorder.read = {}
        dpar.checkpoint.load_safetensors(model, sources["odd"])
        label = f"uneven {strategy}"
        results["read"][label], results["local"][label] = recorder.read, local_sizes(model)
        results["loaded"][label] = dpar.checkpoint.full_state_dict(model)
    if HAS_TITAN:  # a state-dict hook splits the fused wqkv: loaded through load_state_dict as well
        source = third_party.build("titan_llama3")
        with torch.no_grad():
            for p in source.parameters():
                p.add_(0.01)
        dpar.checkpoint.save_safetensors(source, os.path.join(out, "titan"), max_shard_size="2MB")
        model = parallelized("titan_llama3", "tp", rank, world_size)
        recorder.read = {}
        dpar.checkpoint.load_safetensors(model, os.path.join(out, "titan"))
        results["titan"] = (dpar.checkpoint.full_state_dict(model), dict(source.state_dict()))
    # Tied LM head (GPT-2): the file holds the embedding only.
    model = parallelized("gpt2", "tp", rank, world_size)
    recorder.read = {}
    dpar.checkpoint.load_safetensors(model, sources["gpt2"], prefix="inner.")
    results["read"]["gpt2 tp"], results["local"]["gpt2 tp"] = recorder.read, local_sizes(model)
    results["loaded"]["gpt2 tp"] = dpar.checkpoint.full_state_dict(model)
    results["exported"]["gpt2 tp"] = exported(model, os.path.join(out, "gpt2_tp"), rank)
    return results if rank == 0 else {"read": results["read"], "local": results["local"], "bad_fsdp": results["bad_fsdp"]}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Each model saved by Hugging Face's own save_pretrained, in several shard files with an index."""
    root = tmp_path_factory.mktemp("safetensors_sources")
    paths = {}
    for name in ("llama", "gpt2"):
        paths[name] = str(root / name)
        source_model(name).inner.save_pretrained(paths[name], max_shard_size=SHARD)
        assert os.path.isfile(os.path.join(paths[name], "model.safetensors.index.json"))
        assert len([f for f in os.listdir(paths[name]) if f.endswith(".safetensors")]) >= 3
    from safetensors.torch import save_file

    paths["odd"] = str(root / "odd.safetensors")  # one file, not a directory
    save_file(odd_model(seed=3).state_dict(), paths["odd"])
    return paths


def source_state(name: str) -> dict[str, torch.Tensor]:
    if name.startswith("uneven"):
        return dict(odd_model(seed=3).state_dict())
    return {k: v.detach() for k, v in source_model(name).state_dict().items()}  # a fresh model: no copy needed


def source_of(case: str) -> str:
    return "gpt2" if case.startswith("gpt2") else case if case.startswith("uneven") else "llama"


def rewritten(source: str, directory: str, change) -> str:
    """The checkpoint at ``source`` as one ``model.safetensors`` whose tensors ``change`` edited."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in sorted(os.listdir(source)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(source, file)))
    change(tensors)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory


def wrong_shape(tensors: dict) -> None:
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()


@pytest.fixture(scope="module")
def results(sources, tmp_path_factory) -> tuple[dict, list[dict]]:
    root = tmp_path_factory.mktemp("safetensors_out")
    bad = rewritten(sources["llama"], str(root / "bad"), wrong_shape)
    ranks = run_ranks(on_two_ranks, 2, sources, bad, str(root), timeout_s=600)
    return ranks[0], ranks


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("strategy", [*STRATEGIES, "gpt2 tp", "uneven fsdp", "uneven tp"])
def test_every_parameter_loads_exactly(results, strategy: str) -> None:
    loaded = results[0]["loaded"][strategy]
    want = source_state(source_of(strategy))
    assert loaded.keys() == want.keys()
    for key in want:
        assert torch.equal(loaded[key], want[key]), key


@pytest.mark.parametrize("strategy", [*STRATEGIES, "gpt2 tp", "uneven fsdp", "uneven tp"])
def test_each_rank_reads_only_its_own_block(results, strategy: str) -> None:
    per_rank = [(r["read"][strategy], r["local"][strategy]) for r in results[1]]
    for read, local in per_rank:
        assert read == local  # every tensor read once, exactly the elements this rank holds
    unique = {v.data_ptr(): v.numel() for v in source_state(source_of(strategy)).values()}
    full = sum(unique.values())  # what the file holds: a tied weight once
    read = [sum(r.values()) for r, _ in per_rank]
    print(f"{strategy}: elements read per rank {read}, of {full} in the file")
    if strategy != "ddp":
        assert all(n < full for n in read)


@pytest.mark.parametrize("strategy", TRAINED)
def test_trains_like_torch_ddp_from_the_same_file(results, strategy: str) -> None:
    assert max_abs_diff(results[0]["ddp_reference"], source_state("llama")) > 1e-3  # training moved it
    diff = max_abs_diff(results[0]["trained"][strategy], results[0]["ddp_reference"])
    print(f"{strategy} vs torch DDP after {STEPS} AdamW steps: {diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.parametrize("strategy", [*TRAINED, "gpt2 tp"])
def test_export_opens_with_from_pretrained(results, strategy: str) -> None:
    out = results[0]["exported"][strategy]
    assert "model.safetensors.index.json" in out["files"] and "config.json" in out["files"]
    assert out["opened"].keys() == out["model"].keys()
    for key in out["model"]:
        assert torch.equal(out["opened"][key], out["model"][key]), key


def test_torchtitan_fused_qkv_hook_loads_under_tp(results) -> None:
    if not HAS_TITAN:
        pytest.skip("torchtitan is not installed")
    loaded, want = results[0]["titan"]
    assert loaded.keys() == want.keys()
    for key in want:
        assert torch.equal(loaded[key], want[key]), key


def test_a_bad_file_is_refused_on_every_rank_before_any_write(results) -> None:
    for rank in results[1]:
        assert "model.norm.weight" in rank["bad_fsdp"] and "shape" in rank["bad_fsdp"], rank["bad_fsdp"]
    assert max_abs_diff(results[0]["after_bad_fsdp"], results[0]["loaded"]["fsdp"]) == 0


# Bad input, one process, a plain model.


def expect_refusal(directory: str, *needles: str, prefix: str = "inner.", **kwargs) -> None:
    import dpar
    import third_party

    model = third_party.build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dpar.SafetensorsCheckpointError) as caught:
        dpar.checkpoint.load_safetensors(model, directory, prefix=prefix, **kwargs)
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))
    assert max_abs_diff(model.state_dict(), before) == 0


def test_absent_shard_file(sources, tmp_path) -> None:
    directory = str(tmp_path / "partial")
    shutil.copytree(sources["llama"], directory)
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        absent = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(directory, absent))
    expect_refusal(directory, absent, "absent")


def test_renamed_tensor(sources, tmp_path) -> None:
    def rename(tensors: dict) -> None:
        tensors["model.norm.scale"] = tensors.pop("model.norm.weight")

    directory = rewritten(sources["llama"], str(tmp_path / "renamed"), rename)
    expect_refusal(directory, "model.norm.weight", "model.norm.scale", "strict=False")
    # strict=False loads everything else and leaves the renamed tensor as it was.
    import dpar
    import third_party

    model = third_party.build("llama")
    norm = model.inner.model.norm.weight.detach().clone()
    dpar.checkpoint.load_safetensors(model, directory, prefix="inner.", strict=False)
    want = source_state("llama")
    assert torch.equal(model.inner.model.norm.weight, norm)
    assert torch.equal(model.inner.lm_head.weight, want["inner.lm_head.weight"])


def test_wrong_shape(sources, tmp_path) -> None:
    expect_refusal(rewritten(sources["llama"], str(tmp_path / "shape"), wrong_shape), "model.norm.weight", "[31]", "[32]")


def test_wrong_dtype_is_refused_unless_cast(sources, tmp_path) -> None:
    def double(tensors: dict) -> None:
        tensors["model.norm.weight"] = tensors["model.norm.weight"].double()

    directory = rewritten(sources["llama"], str(tmp_path / "dtype"), double)
    expect_refusal(directory, "model.norm.weight", "F64", "torch.float32", "cast=True")
    import dpar
    import third_party

    model = third_party.build("llama")
    dpar.checkpoint.load_safetensors(model, directory, prefix="inner.", cast=True)
    assert max_abs_diff(model.state_dict(), source_state("llama")) == 0


def test_names_without_the_wrapper_prefix_say_which_prefix(sources) -> None:
    expect_refusal(sources["llama"], "not in the checkpoint: inner.model.embed_tokens.weight", "prefix='inner.'", prefix="")
