"""Profile-guided kernel costs: a device description carrying the graphs' kernels timed on this machine
(``dpar.compiler.kernel_profile.time_kernels``), priced by ``node_cost`` in place of the roofline, through
``dpar.explain(profile_kernels=True)`` and ``dpar inspect --profile-kernels``."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from dpar.cli import main
from dpar.compiler.collectives import runs_an_op
from dpar.compiler.costs import PRESETS, is_kernel, kernel_key, node_cost, roofline
from dpar.compiler.kernel_profile import time_kernels
from dpar.core.errors import OptionsError
from dpar.explaining import explain
from pipeline_models import mse, stack


class SmallConvNet(nn.Module):
    """Narrow convolutions and BatchNorm: kernels that run far from a CPU's peak (oneDNN's fixed cost a call)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv, self.head = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(torch.relu(self.norm(self.stem(x)))))
        return nn.functional.cross_entropy(self.head(h.mean(dim=(2, 3))), y)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def _report(**kwargs):
    torch.manual_seed(0)
    return explain(SmallConvNet(), _inputs(), world_size=2, strategy="fsdp", device="cpu", **kwargs)


def _graphs(report) -> list[fx.GraphModule]:
    """The forward and backward graphs the report prices (not the joint graph it shows)."""
    return [view.graph for view in report.graphs if view.label != "joint graph"]


def test_every_op_of_the_graphs_is_timed_and_priced_at_its_time() -> None:
    graphs = _graphs(_report())
    times = time_kernels(graphs, torch.device("cpu"))
    ops = [n for gm in graphs for n in gm.graph.nodes if runs_an_op(n)]
    assert times.untimed == 0 and len(times.seconds) == len({kernel_key(n) for n in ops})
    assert all(seconds > 0 for _, seconds in times.seconds)
    profiled = dataclasses.replace(PRESETS["cpu"], kernel_times=times)
    for node in ops:
        assert node_cost(node, profiled).seconds == times.by_key[kernel_key(node)]
    # A view costs nothing by the roofline, its dispatch where timed; a collective or a wait nothing either way.
    views = [n for n in ops if not is_kernel(n)]
    assert views and all(node_cost(n, PRESETS["cpu"]).seconds == 0 < node_cost(n, profiled).seconds for n in views)
    others = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and not runs_an_op(n)]
    assert others and all(node_cost(n, profiled).seconds == 0 for n in others)


def test_a_kernel_past_the_size_limit_keeps_the_roofline() -> None:
    graphs = _graphs(_report())
    convolutions = [n for gm in graphs for n in gm.graph.nodes if runs_an_op(n) and "convolution" in str(n.target)]
    times = time_kernels(graphs, torch.device("cpu"), max_bytes=2_000)
    assert times.untimed > 0 and times.describe().endswith(f", {times.untimed} by the roofline")
    profiled = dataclasses.replace(PRESETS["cpu"], kernel_times=times)
    large = [n for n in convolutions if kernel_key(n) not in times.by_key]
    assert large
    for node in large:
        cost = node_cost(node, profiled)
        assert cost.seconds == roofline(cost.flops, cost.bytes, torch.float32, PRESETS["cpu"]) > 0


def test_explain_prices_the_report_with_the_kernels_timed_here() -> None:
    rooflined, profiled = _report(), _report(profile_kernels=True)
    assert rooflined.device == "cpu" and profiled.device.startswith("cpu (") and "kernels timed on cpu)" in profiled.device
    # The same graphs and collectives; only compute is priced differently.
    assert profiled.collectives == rooflined.collectives
    assert profiled.memory == rooflined.memory
    # These convolutions run far from the cpu preset's 100 GFLOP/s: what a call costs before any arithmetic. Compared
    # without the host work around the graphs, a fixed term of both (0.5 ms) that would make the ratio the machine's.
    def kernels(report) -> float:
        host = sum(e.end - e.start for e in report.timeline.events
                   if e.rank == 0 and e.stream == "compute" and e.name == "host work around the graphs")
        return report.timeline.compute_time - host

    assert kernels(profiled) > 2 * kernels(rooflined) > 0, (kernels(profiled), kernels(rooflined))


def test_a_model_on_meta_is_timed_on_made_up_inputs() -> None:
    with torch.device("meta"):
        torch.manual_seed(0)
        model = SmallConvNet()
    inputs = tuple(t.to("meta") for t in _inputs())
    report = explain(model, inputs, world_size=2, strategy="ddp", device="cpu", profile_kernels=True)
    assert "kernels timed on cpu" in report.device and "by the roofline" not in report.device
    assert report.timeline.compute_time > 0


def test_kernels_timed_on_one_machine_are_not_priced_as_another() -> None:
    with pytest.raises(OptionsError, match=r"profile_kernels times the kernels on this machine's cpu, but device='h100'"):
        explain(SmallConvNet(), _inputs(), world_size=2, strategy="ddp", device="h100", profile_kernels=True)
    with pytest.raises(OptionsError, match=r"profile_kernels times the kernels on this machine's cpu, but device='h100'"):
        explain(SmallConvNet(), _inputs(), world_size=2, strategy="pipeline", profile_kernels=True, stages=2, micro_batches=2)


def test_pipeline_stages_are_priced_with_their_kernels_timed_here() -> None:
    """Each stage's forward (and the recomputation B and I run) at its kernels' measured times."""
    model, inputs = stack()
    kwargs = dict(world_size=2, strategy="pipeline", device="cpu", stages=2, micro_batches=2, loss_fn=mse)
    rooflined = explain(model, inputs, **kwargs)
    profiled = explain(model, inputs, profile_kernels=True, **kwargs)
    assert profiled.device == "cpu (kernels timed on cpu)" and rooflined.device == "cpu"
    assert [s.activation_bytes for s in profiled.stages] == [s.activation_bytes for s in rooflined.stages]
    # Small kernels: each costs its dispatch at least, far above the roofline at 100 GFLOP/s.
    assert all(p.forward_s > 2 * r.forward_s > 0 for p, r in zip(profiled.stages, rooflined.stages))


def test_inspect_profile_kernels_flag(tmp_path, capsys) -> None:
    target = tmp_path / "convnet.py"
    target.write_text(textwrap.dedent('''
        import torch, torch.nn as nn

        def default():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
            model(torch.randn(2, 3, 8, 8))
            return model, (torch.randn(2, 3, 8, 8),)
    '''))
    assert main(["inspect", str(target), "-n", "2", "--device", "cpu", "--profile-kernels"]) == 0
    assert "kernels timed on cpu" in capsys.readouterr().out
    assert main(["inspect", str(target), "-n", "2", "--profile-kernels"]) == 2
    assert "device='h100' describes a GPU" in capsys.readouterr().out


def test_kernel_keys_do_not_depend_on_the_device_traced_on() -> None:
    """A report traced on meta finds the kernels timed for the same model traced on real tensors."""
    real = _graphs(_report())
    with torch.device("meta"):
        torch.manual_seed(0)
        model = SmallConvNet()
    meta = _graphs(explain(model, tuple(t.to("meta") for t in _inputs()), world_size=2, strategy="fsdp", device="cpu"))
    keys = lambda graphs: {kernel_key(n) for gm in graphs for n in gm.graph.nodes if runs_an_op(n)}  # noqa: E731
    assert keys(meta) == keys(real)
