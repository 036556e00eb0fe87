"""Checkpoints that cannot be torn: a save stopped anywhere leaves the previous checkpoint loadable;
a damaged checkpoint, another model's, or another layout's is refused by name before anything loads;
async_save writes a copy taken when it was called.

One process without a process group for the faults (the directory protocol is the same on every
rank), one 2-rank run for what needs ranks: async save under training, ddp <-> fsdp resharding,
zero1's per-rank state, a damaged file seen by one rank's share of the hashing.
"""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import dpar
from distributed import run_ranks
from dpar.runtime import checkpoint, checkpoint_files
from models import MLP

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in optimizer.state.items():
        state.update({f"optimizer.{names[id(p)]}.{k}": v.clone() for k, v in s.items()})
    return state


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def loaded(path: str, optimizer: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(99)  # other weights than any saved run
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(model, opt if optimizer else None, path)
    return snapshot(model, opt)


@pytest.fixture
def two_checkpoints(tmp_path) -> tuple[str, dict, torch.nn.Module, torch.optim.Optimizer]:
    """A checkpoint of step 2 at ``path``, and the model and optimizer trained on to step 3."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trained(model, opt, range(2))
    path = str(tmp_path / "ckpt")
    checkpoint.save(model, opt, path)
    old = snapshot(model, opt)
    trained(model, opt, range(2, 3))
    return path, old, model, opt


class Stop(Exception):
    pass


@pytest.mark.parametrize("point", checkpoint_files.FAULT_POINTS)
def test_a_save_stopped_at_any_point_leaves_a_complete_checkpoint(two_checkpoints, monkeypatch, point) -> None:
    path, old, model, opt = two_checkpoints
    new = snapshot(model, opt)

    def stop(reached: str) -> None:
        if reached == point:
            raise Stop(reached)

    monkeypatch.setattr(checkpoint_files, "_at_point", stop)
    with pytest.raises(Stop):
        checkpoint.save(model, opt, path)
    monkeypatch.setattr(checkpoint_files, "_at_point", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = loaded(path)
    # Published is the only point after which the new checkpoint is the one at path.
    assert_bitwise_equal(got, new if point == "published" else old)
    assert any("holds the checkpoint published before it" in str(w.message) for w in caught) == (point == "retired")
    # The next save finishes what the stopped one left, and leaves nothing else beside path.
    checkpoint.save(model, opt, path)
    assert_bitwise_equal(loaded(path), new)
    assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt"]


def _save_and_die(path: str, point: str) -> None:
    """A process killed by SIGKILL at ``point`` of a save ('mid-write': after DCP's first tensor)."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    torch.manual_seed(1)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trained(model, opt, range(3))

    def die(*args: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "mid-write":
        write_item = dcp_files._write_item

        def write_then_die(*args: object, **kwargs: object) -> object:
            result = write_item(*args, **kwargs)
            die()
            return result

        dcp_files._write_item = write_then_die
    else:
        checkpoint_files._at_point = lambda reached: die() if reached == point else None
    checkpoint.save(model, opt, path)


@pytest.mark.parametrize("point", ["mid-write", "written", "retired"])
def test_a_process_killed_inside_save_leaves_the_previous_checkpoint(two_checkpoints, point) -> None:
    path, old, _, _ = two_checkpoints
    process = mp.get_context("spawn").Process(target=_save_and_die, args=(path, point))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == -signal.SIGKILL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_bitwise_equal(loaded(path), old)


def damage(path: str, how: str) -> None:
    data = os.path.join(path, "__0_0.distcp")
    if how == "flipped byte":
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    elif how == "truncated":
        os.truncate(data, os.path.getsize(data) - 100)
    elif how == "file deleted":
        os.remove(os.path.join(path, ".metadata"))
    elif how == "manifest deleted":
        os.remove(os.path.join(path, "manifest.json"))
    elif how == "manifest truncated":
        os.truncate(os.path.join(path, "manifest.json"), 40)


@pytest.mark.parametrize(
    "how, message",
    [
        ("flipped byte", r"is damaged: __0_0.distcp \(same size, other sha256\) differ"),
        ("truncated", r"is damaged: __0_0.distcp \(\d+ bytes, the manifest says \d+\) differ"),
        ("file deleted", r"is damaged: .metadata \(missing\) differ"),
        ("manifest deleted", r"has no manifest.json: it is not a checkpoint dpar.checkpoint.save published"),
        ("manifest truncated", r"the manifest of .* is corrupt \(JSONDecodeError"),
    ],
)
def test_a_damaged_checkpoint_is_refused_by_name_and_loads_nothing(two_checkpoints, how, message) -> None:
    path, _, model, opt = two_checkpoints
    damage(path, how)
    before = snapshot(model, opt)
    with pytest.raises(dpar.CheckpointError, match=message):
        checkpoint.load(model, opt, path)
    assert_bitwise_equal(snapshot(model, opt), before)


def test_a_checkpoint_of_another_model_names_the_tensors_that_differ(two_checkpoints) -> None:
    path, *_ = two_checkpoints
    other = torch.nn.Sequential(torch.nn.Linear(16, 4))
    with pytest.raises(dpar.CheckpointError, match=r"saved from another model; not in this model: "
                       r"net.0.weight, net.0.bias, net.2.weight, net.2.bias and 2 more; not in the checkpoint: "
                       r"0.weight, 0.bias. Build the model with the configuration that saved it"):
        checkpoint.load(other, None, path)
    wider = MLP()
    wider.net[2] = torch.nn.Linear(64, 80)
    with pytest.raises(dpar.CheckpointError, match=r"shapes or dtypes differ: net.2.weight is float32\[64, 64\] in the checkpoint, float32\[80, 64\] here"):
        checkpoint.load(wider, None, path)


def test_optimizer_state_of_another_class_is_refused(two_checkpoints) -> None:
    path, _, model, _ = two_checkpoints
    with pytest.raises(dpar.CheckpointError, match="holds AdamW state, and this optimizer is a SGD: build a AdamW"):
        checkpoint.load(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), path)


def test_no_checkpoint_at_the_path_is_named(tmp_path) -> None:
    with pytest.raises(dpar.CheckpointError, match="no checkpoint at"):
        checkpoint.load(MLP(), None, str(tmp_path / "nothing"))


def test_async_save_writes_the_state_of_the_moment_it_was_called(two_checkpoints) -> None:
    path, _, model, opt = two_checkpoints
    at_call = snapshot(model, opt)
    future = checkpoint.async_save(model, opt, path)
    trained(model, opt, range(3, 6))  # changes every parameter while the thread may still write
    assert future.result() is None
    assert_bitwise_equal(loaded(path), at_call)


def test_a_failed_async_save_is_raised_by_the_next_save(two_checkpoints, monkeypatch) -> None:
    path, old, model, opt = two_checkpoints

    def stop(reached: str) -> None:
        if reached == "written":
            raise Stop("disk full")

    monkeypatch.setattr(checkpoint_files, "_at_point", stop)
    checkpoint.async_save(model, opt, path)
    with pytest.raises(dpar.CheckpointError, match=r"previous dpar.checkpoint.async_save failed \(Stop: disk full\)"):
        checkpoint.save(model, opt, path)
    assert_bitwise_equal(loaded(path), old)


def on_two_ranks(rank: int, world_size: int, directory: str) -> dict:
    """ddp trains with an async save under way; its checkpoint loads into fsdp; fsdp's is kept for one
    process; a zero1 checkpoint is refused by ddp; a file one rank damaged is refused on both."""
    import torch.distributed as dist

    def build(strategy: str | None, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module]:
        torch._dynamo.reset()
        torch.manual_seed(seed)
        model = MLP() if strategy is None else dpar.parallelize(MLP(), strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})

    def train(runner: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x, y = (t.chunk(world_size)[rank] for t in (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)))
            opt.zero_grad()
            F.mse_loss(runner(x), y).backward()
            opt.step()

    results: dict = {}
    model, opt, compiled = build(None)
    train(compiled, opt, range(2))
    results["ddp_saved"] = checkpoint.full_state_dict(model)
    future = checkpoint.async_save(compiled, opt, f"{directory}/ddp")
    train(compiled, opt, range(2, 4))  # collectives on the default group while the thread writes on its own
    future.result()
    results["ddp_trained_on"] = checkpoint.full_state_dict(model)

    fsdp, fsdp_opt, _ = build("fsdp", seed=5)
    checkpoint.load(fsdp, fsdp_opt, f"{directory}/ddp")  # replicated -> sharded
    results["fsdp_loaded"] = checkpoint.full_state_dict(fsdp)
    checkpoint.save(fsdp, fsdp_opt, f"{directory}/fsdp")  # for one plain process to load

    zero1, _, _ = build("zero1")
    checkpoint.save(zero1, None, f"{directory}/zero1")
    try:
        checkpoint.load(model, None, f"{directory}/zero1")
    except dpar.CheckpointError as exc:
        results["zero1_into_ddp"] = str(exc)

    if rank == 0:
        # Sorted, the files are .metadata, __0_0.distcp, __1_0.distcp: rank 1 hashes the second, rank 0 the others.
        damage(f"{directory}/ddp", "flipped byte")
        os.truncate(f"{directory}/ddp/__1_0.distcp", 1)
    dist.barrier()
    try:
        checkpoint.load(model, opt, f"{directory}/ddp")
    except dpar.CheckpointError as exc:
        results["damaged"] = str(exc)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], str]:
    directory = str(tmp_path_factory.mktemp("two_ranks"))
    return run_ranks(on_two_ranks, 2, directory, timeout_s=240), directory


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_async_save_under_training_holds_the_parameters_of_its_call(ranks) -> None:
    (rank0, _), _ = ranks
    assert max_abs_diff(rank0["ddp_trained_on"], rank0["ddp_saved"]) > 1e-3  # training went on meanwhile
    assert max_abs_diff(rank0["fsdp_loaded"], rank0["ddp_saved"]) == 0.0


def test_a_two_rank_ddp_checkpoint_loads_into_fsdp_and_fsdps_into_one_process(ranks) -> None:
    (rank0, _), directory = ranks
    torch.manual_seed(7)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(model, opt, f"{directory}/fsdp")  # sharded on 2 ranks -> one process
    assert max_abs_diff(model.state_dict(), rank0["ddp_saved"]) == 0.0
    assert all(state["step"].item() == 2 for state in opt.state.values())


def test_zero1_per_rank_state_is_refused_under_another_strategy_on_every_rank(ranks) -> None:
    results, _ = ranks
    for result in results:
        assert "saved under zero1 on 2 rank(s); this run is ddp on 2: it holds each rank's own state" in result["zero1_into_ddp"]
        assert "resumes only under zero1 on 2 rank(s)" in result["zero1_into_ddp"]


def test_a_file_damaged_in_one_ranks_share_is_refused_on_every_rank(ranks) -> None:
    results, _ = ranks
    for result in results:
        assert "__0_0.distcp (same size, other sha256)" in result["damaged"]
        assert "__1_0.distcp (1 bytes, the manifest says" in result["damaged"]
