"""Timing the kernels of compiled graphs on this machine's device (see [Note: profile-guided kernel costs]
in ``costs.py``): what a ``DeviceSpec`` carries as ``kernel_times``."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx

from dpar.compiler.collectives import runs_an_op
from dpar.compiler.costs import DeviceSpec, KernelKey, KernelTimes, example_value, kernel_bytes, kernel_key
from dpar.core.errors import OptionsError
from dpar.core.torch_internals import pytree

MAX_KERNEL_BYTES = 1 << 30
"""A kernel whose tensors (inputs and output) hold more is priced by the roofline, not run: timing a 70B
model's layer on a CPU would take longer than the planning it serves."""


CPU_EVICT_BYTES = 1 << 20
"""Written between two timed runs of a kernel on a CPU: one core's private (L2) cache. Run back to back, a
kernel finds its operands in L2; in a step, kernels in between have evicted them to the shared L3. On this
project's 2-core EPYC (512 KiB L2 a core, 32 MiB L3) timing without it priced ConvBN's step (ddp, 2 ranks)
at 17.9 ms and HF Llama 4M's at 132 ms, with it 21.9 and 149 ms; evicting L3 too (64 MiB) 64 and 285 ms,
past what a step takes (17-23 and 133-209 ms measured on 2 ranks, one afternoon)."""


def with_kernel_times(spec: DeviceSpec, graphs: Iterable[fx.GraphModule], device: torch.device) -> DeviceSpec:
    """``spec`` carrying ``graphs``' kernels timed on ``device`` (``timing_device(spec)``)."""
    return dataclasses.replace(spec, kernel_times=time_kernels(graphs, device))


def timing_device(spec: DeviceSpec) -> torch.device:
    """This machine's device (CUDA where there is one), refused where ``spec`` is a preset of another kind: a
    report would price one machine's kernels with another's links."""
    here = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    preset_for = {"cpu": "cpu", "h100": "cuda", "h200": "cuda"}.get(spec.name)
    if preset_for not in (None, here.type):
        raise OptionsError(
            f"profile_kernels times the kernels on this machine's {here.type}, but device={spec.name!r} describes "
            f"{'a GPU' if preset_for == 'cuda' else 'a CPU'}: the report would price one machine's kernels with "
            f"another's links. Pass device='{'cpu' if here.type == 'cpu' else 'h100'}' (or a DeviceSpec of this "
            "machine), or run on the device the report is for."
        )
    return here


def time_kernels(graphs: Iterable[fx.GraphModule], device: torch.device, *, repeats: int = 5, warmups: int = 2,
                 max_bytes: int = MAX_KERNEL_BYTES, evict_bytes: int | None = None) -> KernelTimes:
    """Each distinct kernel (or view) of ``graphs`` (``kernel_key``) run on ``device`` on inputs of its traced shapes,
    strides and dtypes (floating values uniform in [-1, 1], integer ones 0: a valid index for every
    embedding, gather and loss target), its median time over ``repeats`` runs after ``warmups``.

    A CPU kernel is timed by the thread's CPU time when torch runs one intra-op thread (what a
    neighbour's load on a shared machine does not inflate), else by the wall clock, with ``evict_bytes``
    (default ``CPU_EVICT_BYTES``) written between two runs; a CUDA kernel by CUDA events, back to back
    (``evict_bytes`` 0 unless given)."""
    if evict_bytes is None:
        evict_bytes = CPU_EVICT_BYTES if device.type == "cpu" else 0
    scratch = torch.zeros(evict_bytes // 4, device=device)
    clock = _clock(device, (lambda: scratch.add_(1)) if evict_bytes else (lambda: None))
    seconds: dict[KernelKey, float] = {}
    untimed: set[KernelKey] = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            if not runs_an_op(node):
                continue
            key = kernel_key(node)
            if key in seconds or key in untimed:
                continue
            run = _runnable(node, device) if kernel_bytes(node) <= max_bytes else None
            measured = _median(run, clock, repeats, warmups) if run is not None else None
            if measured is None:
                untimed.add(key)
            else:
                seconds[key] = measured
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return KernelTimes(name, tuple(seconds.items()), len(untimed))


def _runnable(node: fx.Node, device: torch.device) -> Callable[[], Any] | None:
    """The node's call on made-up inputs on ``device``; None where an input cannot be made."""
    try:
        args, kwargs = pytree.tree_map(lambda a: _made_up(a, device), (node.args, dict(node.kwargs)))
    except (RuntimeError, TypeError, ValueError):
        return None
    return lambda: node.target(*args, **kwargs)


def _made_up(arg: Any, device: torch.device) -> Any:
    if isinstance(arg, torch.device):
        return device
    if not isinstance(arg, fx.Node):
        return arg
    value = example_value(arg)
    if isinstance(value, (list, tuple)):
        return type(value)(_tensor_like(v, device) if isinstance(v, torch.Tensor) else v for v in value)
    return _tensor_like(value, device) if isinstance(value, torch.Tensor) else value


def _tensor_like(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``value``'s shape, strides and dtype on ``device``: its storage allocated whole and filled,
    then viewed (an expanded or overlapping layout cannot be filled through the view)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride())) if value.numel() else 0
    storage = torch.empty(span, dtype=value.dtype, device=device)
    if storage.is_floating_point() or storage.is_complex():
        storage.uniform_(-1, 1)
    else:
        storage.zero_()
    return storage.as_strided(value.shape, value.stride())


def _clock(device: torch.device, evict: Callable[[], Any]) -> Callable[[Callable[[], Any]], float]:
    """Seconds of one ``run``, ``evict`` run untimed before it."""
    if device.type == "cuda":
        def timed(run: Callable[[], Any]) -> float:
            evict()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return timed
    now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    def timed_on_cpu(run: Callable[[], Any]) -> float:
        evict()
        start = now()
        run()
        return now() - start
    return timed_on_cpu


def _median(run: Callable[[], Any], clock: Callable[[Callable[[], Any]], float], repeats: int, warmups: int) -> float | None:
    """None where the call raises on made-up inputs (an op whose values matter, e.g. a size read from a tensor)."""
    try:
        for _ in range(warmups):
            run()
        return statistics.median(clock(run) for _ in range(repeats))
    except (RuntimeError, IndexError, ValueError, TypeError):
        return None
