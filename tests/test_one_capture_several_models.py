"""[Note: one capture, several models]: models of one class in one process, each trained by its own plan.

Dynamo hands the backend one capture for every model of a class whose parameters have the same shapes; each
model must still run the graphs of its own plan, checked against torch DDP on the same rows.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import dpar
from dpar.compiler.collectives import collectives
from distributed import run_ranks
from fake_world import fake_world
from gpt import GPT, GPTConfig
from third_party import float64_by_default

STEPS = 3


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))


def _three_models(rank: int, world_size: int) -> dict[str, float]:
    """A local SGD model (replicas averaged every 100 steps), a plain (ddp) one and a cp one of one class, compiled in
    that order and trained in turns; the last two against torch DDP from the same weights on the same rows: max
    |parameter - torch DDP's| after 3 SGD steps."""
    with float64_by_default():
        reference = DistributedDataParallel(_gpt())
        models = {"local_sgd": _gpt(), "ddp": _gpt(), "cp": _gpt()}
        dpar.parallelize(models["local_sgd"], strategy="local_sgd", sync_every=100)
        dpar.parallelize(models["cp"], strategy="cp")
        compiled = {name: torch.compile(m, backend="dpar", options={"compiler": "aot_eager"}) for name, m in models.items()}
        optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in [*models.items(), ("torch", reference)]}
        generator = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            ids = torch.randint(0, 64, (2, 16), generator=generator)
            for name, run in [*compiled.items(), ("torch", reference)]:
                run(ids, ids.roll(-1, 1)).backward()
                optimizers[name].step()
                optimizers[name].zero_grad()
        expected = reference.module.state_dict()
        return {name: max((models[name].state_dict()[n] - expected[n]).abs().max().item() for n in expected)
                for name in ("ddp", "cp")}


def test_models_of_one_class_each_train_by_their_own_plan() -> None:
    """Before each callable kept its model, the plain and cp models ran the local SGD model's graphs (one capture):
    no gradient reduction, each rank training on its own rows."""
    found = run_ranks(_three_models, 2, timeout_s=300)[0]
    print("max |dpar - torch DDP| (float64, 3 SGD steps):", found)
    assert max(found.values()) <= 1e-12, found


def test_a_second_model_compiles_its_own_graphs_once() -> None:
    """Two cp models with different exchanges in a fake world: the second compiles its graphs (all-to-alls) at its
    first call, and calling the models in turn compiles nothing more."""
    with fake_world(4) as graphs:
        ids = torch.randint(0, 64, (1, 16))
        runs = []
        for exchange in ("all_gather", "all_to_all"):
            model = _gpt()
            dpar.parallelize(model, strategy="cp", mesh=init_device_mesh("cpu", (4,)), same_batch_in_cp_group=True,
                             attention_exchange=exchange)
            runs.append(torch.compile(model, backend="dpar", options={"compiler": "aot_eager"}))
            runs[-1](ids, ids.roll(-1, 1)).backward()
        for run in runs:
            run(ids, ids.roll(-1, 1)).backward()
        labels = [g.label for g in graphs]
        kinds = [{c.kind for c in collectives(g.graph)} for g in graphs if g.label == "forward graph"]
    assert labels == ["joint graph", "forward graph", "backward graph"] * 2, labels
    assert "all_gather" in kinds[0] and "all_to_all" not in kinds[0] and "all_to_all" in kinds[1], kinds
