"""Checkpoints of sharded models: resume in new processes, load at another world size, export
a full state dict that plain PyTorch loads.

Three multi-rank runs, each in new processes: train 10 steps on 2 ranks and save at step 5;
resume from step 5 on 2 ranks; resume from the 2-rank checkpoints on 4 ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from distributed import run_ranks
from models import MLP, FrozenAndUnused, Uneven

SAVE_AT, STEPS = 5, 10
ROWS = 8  # global batch: the same on 1, 2 and 4 ranks
CASES = ["gpt-fsdp", "gpt-zero2", "mlp-fsdp", "mlp-zero2", "uneven-fsdp"]
RESHARDED = ["gpt-fsdp", "uneven-fsdp"]  # uneven: 30 and 5 rows, shards of 15/15 -> 8/8/8/6 and 3/2 -> 2/2/1/0
TRAINED_ON_FOUR_RANKS = ["uneven-fsdp"]  # one small model: a GPT compile on 4 ranks costs ~20 s on 2 cores
RESUME_TOLERANCE = 0.0  # same graphs on the same shards: bitwise (the brief allowed 1e-6)
# ../shared/design/NOTES.md: Adam amplifies fp32 reduction-order noise between a sharded run and one process.
REDUCTION_ORDER_TOLERANCE = 1e-4


def tiny_gpt() -> nn.Module:
    from gpt import GPT, GPTConfig

    return GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))


BUILDERS = {"gpt": tiny_gpt, "mlp": MLP, "uneven": Uneven}


def batch(model_name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if model_name == "gpt":
        tokens = torch.randint(0, 256, (ROWS, 17), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 4, generator=g)


def train(
    model_name: str, runner: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int, world_size: int
) -> None:
    for step in steps:
        x, y = (t.chunk(world_size)[rank] for t in batch(model_name, step))
        loss = runner(x, y) if model_name == "gpt" else F.mse_loss(runner(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def build(case: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    import dpar

    model_name, strategy = case.split("-")
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = BUILDERS[model_name]()
    dpar.parallelize(model, strategy=strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's optimizer state, gathered to full tensors (a collective: all ranks call it)."""
    return {
        name: {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in optimizer.state[p].items()}
        for name, p in model.named_parameters()
        if p in optimizer.state
    }


def train_and_save(rank: int, world_size: int, directory: str) -> dict:
    """Train each case 10 steps, saving at step 5: the checkpoints and the uninterrupted run."""
    from dpar.runtime import checkpoint

    results = {}
    for case in CASES:
        model, optimizer, compiled = build(case, seed=rank)  # parallelize scatters rank 0's parameters
        train(case.split("-")[0], compiled, optimizer, range(SAVE_AT), rank, world_size)
        start = time.perf_counter()
        checkpoint.save(compiled, optimizer, f"{directory}/{case}")
        save_s = time.perf_counter() - start
        saved = checkpoint.full_state_dict(compiled)
        saved_optimizer = full_optimizer_state(model, optimizer)
        train(case.split("-")[0], compiled, optimizer, range(SAVE_AT, STEPS), rank, world_size)
        results[case] = {
            "saved": saved,
            "saved_optimizer": saved_optimizer,
            "uninterrupted": checkpoint.full_state_dict(compiled),
            "save_s": save_s,
        }
    return results


def load_and_train(rank: int, world_size: int, directory: str, loaded: list[str], trained: list[str]) -> dict:
    """Load each case in ``loaded`` into a new model and optimizer; train those in ``trained`` from there."""
    from dpar.runtime import checkpoint

    results = {}
    for case in loaded:
        model, optimizer, compiled = build(case, seed=100 + rank)  # other weights than the saved run's
        start = time.perf_counter()
        checkpoint.load(model, optimizer, f"{directory}/{case}")
        load_s = time.perf_counter() - start
        results[case] = {
            "loaded": checkpoint.full_state_dict(model),
            "loaded_optimizer": full_optimizer_state(model, optimizer),
            "local_rows": {name: p.to_local().shape[0] for name, p in model.named_parameters()},
            "load_s": load_s,
        }
        if case in trained:
            train(case.split("-")[0], compiled, optimizer, range(SAVE_AT, STEPS), rank, world_size)
            results[case]["resumed"] = checkpoint.full_state_dict(model)
    return results


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def saved(directory: str) -> list[dict]:
    return run_ranks(train_and_save, 2, directory, timeout_s=300)


@pytest.fixture(scope="module")
def resumed(saved: list[dict], directory: str) -> list[dict]:
    return run_ranks(load_and_train, 2, directory, CASES, CASES, timeout_s=300)


@pytest.fixture(scope="module")
def resharded(saved: list[dict], directory: str) -> list[dict]:
    return run_ranks(load_and_train, 4, directory, RESHARDED, TRAINED_ON_FOUR_RANKS, timeout_s=300)


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def max_abs_diff_optimizer(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(max_abs_diff(a[name], b[name]) for name in a)


@pytest.mark.parametrize("case", CASES)
def test_resumed_run_reaches_the_uninterrupted_parameters(saved: list[dict], resumed: list[dict], case: str) -> None:
    got, want = resumed[0][case], saved[0][case]
    assert max_abs_diff(got["loaded"], want["saved"]) == 0.0
    assert max_abs_diff_optimizer(got["loaded_optimizer"], want["saved_optimizer"]) == 0.0
    assert all(state["step"].item() == SAVE_AT for state in got["loaded_optimizer"].values())
    assert max_abs_diff(got["resumed"], want["uninterrupted"]) <= RESUME_TOLERANCE
    # The second half moved the parameters: equal results do not come from doing nothing.
    assert max_abs_diff(want["uninterrupted"], want["saved"]) > 1e-3


@pytest.mark.parametrize("case", RESHARDED)
def test_two_rank_checkpoint_loads_on_four_ranks(saved: list[dict], resharded: list[dict], case: str) -> None:
    got, want = resharded[0][case], saved[0][case]
    assert max_abs_diff(got["loaded"], want["saved"]) == 0.0
    assert max_abs_diff_optimizer(got["loaded_optimizer"], want["saved_optimizer"]) == 0.0
    # Each rank holds its 4-rank shard: DTensor's uneven split, torch.chunk sizes, empty shards last.
    for name in got["local_rows"]:
        expected = [len(chunk) for chunk in torch.arange(want["saved"][name].shape[0]).chunk(4)]
        expected += [0] * (4 - len(expected))
        assert [r[case]["local_rows"][name] for r in resharded] == expected, name


@pytest.mark.parametrize("case", TRAINED_ON_FOUR_RANKS)
def test_two_rank_checkpoint_trains_on_four_ranks(saved: list[dict], resharded: list[dict], case: str) -> None:
    got, want = resharded[0][case], saved[0][case]
    assert max_abs_diff(got["resumed"], want["uninterrupted"]) <= REDUCTION_ORDER_TOLERANCE


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP says it loads in one process
def test_sharded_checkpoint_loads_into_a_plain_model_without_process_group(saved: list[dict], directory: str) -> None:
    """2 -> 1: one process, no process group, a plain model and optimizer; then it trains on."""
    from dpar.runtime import checkpoint

    want = saved[0]["gpt-fsdp"]
    torch.manual_seed(100)
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(model, optimizer, f"{directory}/gpt-fsdp")
    assert max_abs_diff(model.state_dict(), want["saved"]) == 0.0
    assert max_abs_diff_optimizer(full_optimizer_state(model, optimizer), want["saved_optimizer"]) == 0.0
    assert model.lm_head.weight is model.tok_emb.weight
    train("gpt", model, optimizer, range(SAVE_AT, STEPS), rank=0, world_size=1)
    assert max_abs_diff(model.state_dict(), want["uninterrupted"]) <= REDUCTION_ORDER_TOLERANCE


def test_full_state_dict_is_on_rank_zero_and_loads_into_a_plain_model(saved: list[dict]) -> None:
    assert saved[1]["gpt-fsdp"]["saved"] is None and saved[1]["gpt-fsdp"]["uninterrupted"] is None
    full = saved[0]["gpt-fsdp"]["uninterrupted"]
    assert all(type(t) is torch.Tensor for t in full.values())
    assert full["lm_head.weight"].data_ptr() == full["tok_emb.weight"].data_ptr()  # tied: one tensor, two names
    model = tiny_gpt()
    model.load_state_dict(full)  # strict: every name, every shape
    assert model.lm_head.weight is model.tok_emb.weight
    assert max_abs_diff(model.state_dict(), full) == 0.0
    x, y = batch("gpt", STEPS)
    assert torch.isfinite(model(x, y))


def test_optimizer_over_other_parameters_is_refused_with_the_fix(tmp_path) -> None:
    from dpar.runtime import checkpoint
    from dpar.core.errors import OptionsError

    model = MLP()
    stale = torch.optim.AdamW(MLP().parameters())  # e.g. built before dpar.parallelize replaced them
    with pytest.raises(OptionsError, match="build the optimizer from model.parameters"):
        checkpoint.save(model, stale, tmp_path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_parameter_without_gradient_stays_without_optimizer_state(tmp_path) -> None:
    """A layer the forward never reads has no AdamW state when saved, and none after load."""
    from dpar.runtime import checkpoint

    model = FrozenAndUnused()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        x, y = batch("mlp", step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    checkpoint.save(model, optimizer, tmp_path)
    fresh = FrozenAndUnused()
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    checkpoint.load(fresh, fresh_optimizer, tmp_path)
    assert [n for n, p in fresh.named_parameters() if p in fresh_optimizer.state] == ["trained.weight", "trained.bias"]
    assert max_abs_diff(fresh.state_dict(), model.state_dict()) == 0.0
    saved_state = full_optimizer_state(model, optimizer)
    assert max_abs_diff_optimizer(full_optimizer_state(fresh, fresh_optimizer), saved_state) == 0.0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_optimizer_load_from_a_weights_only_checkpoint_names_the_fix(tmp_path) -> None:
    from dpar.runtime import checkpoint
    from dpar.core.errors import OptionsError

    checkpoint.save(MLP(), None, tmp_path)
    model = MLP()
    with pytest.raises(OptionsError, match="load it with optimizer=None"):
        checkpoint.load(model, torch.optim.AdamW(model.parameters()), tmp_path)


def load_full_into_parallelized(rank: int, world_size: int) -> dict:
    """A plain state dict (pretrained weights, say) loaded after parallelize lands as shards."""
    import dpar
    from dpar.runtime import checkpoint

    torch.manual_seed(123)
    pretrained = tiny_gpt().state_dict()
    torch.manual_seed(0)
    model = tiny_gpt()
    dpar.parallelize(model, strategy="fsdp")
    model.load_state_dict(pretrained)
    return {"full": checkpoint.full_state_dict(model), "pretrained": pretrained}


def test_plain_state_dict_loads_into_a_parallelized_model() -> None:
    rank0, rank1 = run_ranks(load_full_into_parallelized, 2, timeout_s=300)
    assert rank1["full"] is None
    assert rank0["full"].keys() == rank0["pretrained"].keys()
    assert max_abs_diff(rank0["full"], rank0["pretrained"]) == 0
