"""What a tensor-parallel model exports: ``dpar.checkpoint.full_state_dict`` gives every parameter at its
full shape with torch DDP's values, ``model.state_dict()`` holds DTensors of the whole parameter (never one
rank's bare block), ``torch.save`` of it writes global shapes, and a ``dpar.checkpoint.save`` under tp loads
into a plain model (and back into a fresh tp model, which trains on as if never stopped).

Models: Hugging Face GPT-2 with a vocabulary of 101, which 2 ranks split unevenly (blocks of 51 and 50 rows
of the tied embedding), and torchtitan 0.3.0's Llama 3 debug model, whose fused ``wqkv`` a state-dict hook
splits into ``wq``/``wk``/``wv`` (it exported one rank's block of each before). One ``run_ranks`` call
trains every case on 2 gloo ranks.
"""

from __future__ import annotations

import importlib.util
import io
import os

import pytest
import torch
import torch.nn as nn

from distributed import run_ranks
from training import TOLERANCE

STEPS, LR, VOCAB = 5, 1e-3, 101
HAS_TITAN = importlib.util.find_spec("torchtitan") is not None


class OddVocabGPT2(nn.Module):
    """Hugging Face GPT-2 (tied LM head) with a vocabulary 2 ranks do not divide."""

    def __init__(self) -> None:
        super().__init__()
        import transformers as tf

        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            setattr(config, key, 0.0)
        self.inner = tf.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "gpt2_vocab101":
        return OddVocabGPT2()
    from third_party import build as third_party_build

    return third_party_build(name)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    from third_party import ROWS_PER_RANK, global_batch, rank_slice

    return rank_slice(global_batch(step, ROWS_PER_RANK * world_size), rank, world_size)


def trained(name: str, strategy: str, rank: int, world_size: int, steps: range, model: nn.Module | None = None,
            optimizer: torch.optim.Optimizer | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    import dpar

    torch._dynamo.reset()
    if model is None:
        model = build(name)
        if strategy == "tp":
            dpar.parallelize(model, strategy="tp", example_inputs=batch(0, rank, world_size))
    runner = nn.parallel.DistributedDataParallel(model) if strategy == "torch_ddp" else torch.compile(
        model, backend="dpar", options={"compiler": "aot_eager"}
    )
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in steps:
        optimizer.zero_grad()
        runner(*batch(step, rank, world_size)).backward()
        optimizer.step()
    return model, optimizer


def whole(state: dict) -> dict:
    """Every DTensor of ``state`` gathered (call on every rank), CPU copies."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state by parameter name, each tensor whole (call on every rank)."""
    from dpar.runtime import checkpoint

    by_name = checkpoint._optimizer_state_by_name(checkpoint._unwrap(model), optimizer)["state"]
    return {name: whole(state) for name, state in by_name.items()}


def layout(state: dict) -> dict:
    """name -> (type, global shape, placements) of what a state dict holds."""
    return {k: (type(v).__name__, tuple(v.shape), tuple(map(repr, getattr(v, "placements", ())))) for k, v in state.items()}


def embedding_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 48), nn.Linear(48, 36), nn.ReLU(), nn.Linear(36, 48))


SPLITS = {"0.weight": 0, "1.weight": 0, "1.bias": 0, "3.weight": 1, "3.bias": None}


def two_dimensional(strategy: str, directory: str) -> dict:
    """ddp+tp / fsdp+tp on a (dp 1, tp 2) mesh, untrained: the state dict's layout, its whole values, a plain
    model's load of its DCP checkpoint, and its load of a plain state dict (4-rank meshes need 4 processes)."""
    import dpar
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    want = embedding_mlp().state_dict()
    model = dpar.parallelize(
        embedding_mlp(), strategy=strategy, tp_plan=SPLITS,
        mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")),
    )
    out = {"want": want, "state_dict": layout(model.state_dict()), "whole": whole(model.state_dict())}
    path = os.path.join(directory, strategy.replace("+", "_"))
    dcp.save(model.state_dict(), checkpoint_id=path)
    out["plain_loaded"] = embedding_mlp(seed=1).state_dict()
    dcp.load(out["plain_loaded"], checkpoint_id=path)
    model.load_state_dict(embedding_mlp(seed=2).state_dict())
    return {**out, "reloaded": dpar.checkpoint.full_state_dict(model), "reloaded_want": embedding_mlp(seed=2).state_dict()}


def on_two_ranks(rank: int, world_size: int, directory: str, names: tuple[str, ...]) -> dict:
    import dpar
    import torch.distributed as dist

    results = {strategy: two_dimensional(strategy, directory) for strategy in ("ddp+tp", "fsdp+tp")}
    for name in names:
        ref, _ = trained(name, "torch_ddp", rank, world_size, range(STEPS))
        model, opt = trained(name, "tp", rank, world_size, range(STEPS))
        state = model.state_dict()
        buffer = io.BytesIO()
        torch.save(state, buffer)  # what a user writes on rank 0
        buffer.seek(0)
        out = {
            "ddp": {k: v.detach().clone() for k, v in ref.state_dict().items()},
            "full": dpar.checkpoint.full_state_dict(model),
            "state_dict": layout(state),
            "state_dict_whole": whole(state),
            "torch_saved": layout(torch.load(buffer, weights_only=True)),
        }
        # dpar.checkpoint.save under tp, loaded into a plain model (DCP reshards to full tensors).
        path = os.path.join(directory, name)
        dpar.checkpoint.save(model, opt, path)
        plain = build(name, seed=1)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
        dpar.checkpoint.load(plain, plain_opt, path)
        out["plain_loaded"] = {k: v.detach().clone() for k, v in plain.state_dict().items()}
        out["plain_optimizer"] = optimizer_state(plain, plain_opt)
        out["tp_optimizer"] = optimizer_state(model, opt)
        if name == "gpt2_vocab101":
            # The plain model's checkpoint (saved under ddp) resumes a fresh tp model, which trains on to the
            # parameters of the tp run that never stopped.
            dpar.checkpoint.save(plain, plain_opt, path + "-ddp")
            resumed = build(name, seed=2)
            dpar.parallelize(resumed, strategy="tp", example_inputs=batch(0, rank, world_size))
            resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=LR)
            dpar.checkpoint.load(resumed, resumed_opt, path + "-ddp")
            out["tp_resumed"] = dpar.checkpoint.full_state_dict(resumed)
            trained(name, "tp", rank, world_size, range(STEPS, STEPS + 2), resumed, resumed_opt)
            trained(name, "tp", rank, world_size, range(STEPS, STEPS + 2), model, opt)
            out["tp_resumed_trained"] = dpar.checkpoint.full_state_dict(resumed)
            out["tp_uninterrupted"] = dpar.checkpoint.full_state_dict(model)
        results[name] = out
        dist.barrier()
    return results if rank == 0 else {}


NAMES = ("gpt2_vocab101",) + (("titan_llama3",) if HAS_TITAN else ())


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_ranks(on_two_ranks, 2, str(tmp_path_factory.mktemp("tp_state_dict")), NAMES, timeout_s=900)[0]


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def case(results: dict, name: str) -> dict:
    if name == "titan_llama3":
        pytest.importorskip("torchtitan")
    return results[name]


@pytest.mark.parametrize("name", ["gpt2_vocab101", "titan_llama3"])
def test_full_state_dict_has_full_shapes_and_ddp_values(results: dict, name: str) -> None:
    out = case(results, name)
    ddp, full = out["ddp"], out["full"]
    assert {k: tuple(v.shape) for k, v in full.items()} == {k: tuple(v.shape) for k, v in ddp.items()}
    assert max_abs_diff(full, ddp) <= TOLERANCE["adamw"]
    if name == "titan_llama3":  # the fused wqkv, split by torchtitan's hook: was rank 0's (128, 256) block
        assert full["inner.layers.0.attention.qkv_linear.wq.weight"].shape == (256, 256)


@pytest.mark.parametrize("name", ["gpt2_vocab101", "titan_llama3"])
def test_state_dict_entries_are_dtensors_of_the_whole_parameter(results: dict, name: str) -> None:
    out = case(results, name)
    kinds = out["state_dict"]
    assert {k: shape for k, (_, shape, _) in kinds.items()} == {k: tuple(v.shape) for k, v in out["ddp"].items()}
    assert max_abs_diff(out["state_dict_whole"], out["full"]) == 0.0
    if name == "gpt2_vocab101":  # the tied embedding, 101 rows split 51 / 50: torch.chunk's Shard(0)
        assert kinds["inner.transformer.wte.weight"] == ("DTensor", (VOCAB, 32), ("Shard(dim=0)",))
        assert kinds["inner.lm_head.weight"] == ("DTensor", (VOCAB, 32), ("Shard(dim=0)",))
        assert any(placements == ("Shard(dim=1)",) for _, _, placements in kinds.values())  # row-parallel
    assert sum(kind == "DTensor" for kind, _, _ in kinds.values()) >= 5


@pytest.mark.parametrize("name", ["gpt2_vocab101", "titan_llama3"])
def test_torch_save_of_state_dict_writes_global_shapes(results: dict, name: str) -> None:
    out = case(results, name)
    assert {k: shape for k, (_, shape, _) in out["torch_saved"].items()} == {k: tuple(v.shape) for k, v in out["ddp"].items()}


@pytest.mark.parametrize("name", ["gpt2_vocab101", "titan_llama3"])
def test_checkpoint_saved_under_tp_loads_into_a_plain_model(results: dict, name: str) -> None:
    out = case(results, name)
    assert max_abs_diff(out["plain_loaded"], out["full"]) == 0.0
    assert out["plain_optimizer"].keys() == out["tp_optimizer"].keys()
    for param, state in out["tp_optimizer"].items():
        assert max_abs_diff(out["plain_optimizer"][param], state) == 0.0, param


def test_ddp_checkpoint_resumes_a_tp_run(results: dict) -> None:
    out = results["gpt2_vocab101"]
    assert max_abs_diff(out["tp_resumed"], out["full"]) == 0.0
    assert max_abs_diff(out["tp_resumed_trained"], out["tp_uninterrupted"]) == 0.0


@pytest.mark.parametrize("strategy", ["ddp+tp", "fsdp+tp"])
def test_two_dimensional_state_dicts_are_dtensors_dcp_and_plain_load(results: dict, strategy: str) -> None:
    out = results[strategy]
    data = "Shard(dim=0)" if strategy == "fsdp+tp" else "Replicate()"
    assert out["state_dict"]["0.weight"] == ("DTensor", (VOCAB, 48), ("Shard(dim=0)", data))  # ("tp", "dp") mesh
    assert out["state_dict"]["3.weight"] == ("DTensor", (48, 36), ("Shard(dim=1)", data))
    assert max_abs_diff(out["whole"], out["want"]) == 0.0
    assert max_abs_diff(out["plain_loaded"], out["want"]) == 0.0
    assert max_abs_diff(out["reloaded"], out["reloaded_want"]) == 0.0
