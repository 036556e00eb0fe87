"""The backend as torch.compile finds it, and the one-device path."""

from __future__ import annotations

import subprocess
import sys
import warnings

import torch
import torch.nn.functional as F

from models import MLP


def test_backend_resolves_through_the_entry_point_without_import_dpar() -> None:
    code = (
        "import sys, torch\n"
        "m = torch.nn.Linear(3, 3)\n"
        "out = torch.compile(m, backend='dpar', options={'compiler': 'aot_eager'})(torch.ones(2, 3))\n"
        "assert torch.allclose(out, m(torch.ones(2, 3)))\n"
        "assert 'dpar' in sys.modules\n"  # loaded by torch through the entry point
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def train(model: torch.nn.Module, runner: torch.nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        F.mse_loss(runner(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_without_process_group_it_warns_once_and_matches_plain_pytorch() -> None:
    import dpar.core.world as world

    world._warned_single_device = False
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train(model, compiled)
    torch.manual_seed(0)
    reference = MLP()
    want = train(reference, reference)
    dpar_warnings = [w for w in caught if "dpar:" in str(w.message)]
    assert [str(w.message) for w in dpar_warnings] == [
        "dpar: no process group with more than one rank; running on one device."
    ]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
