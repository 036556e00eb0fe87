"""What the rank processes import and warm up, once, in the server they fork from (``distributed.RANK_CONTEXT``).

A process's first compiled step pays about a second of lazy set-up (Dynamo's and AOTAutograd's first trace, dpar's
first passes) that later steps do not; every rank of every launch paid it. The server pays it once here, on a
tiny model over the fake process group, which it destroys again: nothing is left running (no thread, no process
group, no compiled code: Dynamo's cache is reset), so a fork of it is a fresh rank with warm imports. Inductor is
not warmed up: its compile workers must not be forked. Hugging Face's model code is imported where it is
installed (.ci/run's newest-torch stage has none; the forkserver ignores a preload that fails to import, but
this one must not fail for that).
"""

import torch
import torch._dynamo
import torch._functorch.aot_autograd
import torch.distributed
import torch.distributed.tensor
from torch import nn

import dpar
from fake_world import fake_world

try:
    from transformers.models import bert, gpt2, llama, mixtral, t5  # noqa: F401
except ImportError:
    pass


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def _warm_up() -> None:
    with fake_world(2):
        for strategy in ("ddp", "fsdp"):
            model, x = _Tiny(), torch.randn(4, 8)
            dpar.parallelize(model, strategy=strategy, example_inputs=(x,))
            torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})(x).backward()


_warm_up()
