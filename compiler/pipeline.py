"""What every strategy's hook shares: running an ordered list of passes, then checking and lowering.

The ordered passes themselves live with each strategy: ``data_parallel`` (ddp),
``sharded_data_parallel`` (zero2, fsdp, hsdp) and ``tensor_parallel`` (tp and
the 2-D strategies). The joint forward+backward graph's passes, which run before
AOTAutograd's partitioner, go through the same runner (``joint_pipeline``), so
they are logged and recorded like the forward's and backward's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from dpar.compiler.collectives import collectives
from dpar.compiler.graph_utils import refresh_fake_values
from dpar.compiler.inspect.logs import configure as configure_logs
from dpar.compiler.inspect.logs import log_pass
from dpar.compiler.lowering import Lower
from dpar.compiler.options import Options
from dpar.compiler.registry import STAGES_KEY, PassStage, record
from dpar.runtime.agreement import agree
from dpar.runtime.world import World, group_size

Pass = tuple[str, Callable[[fx.GraphModule], fx.GraphModule]]


def run_passes(gm: fx.GraphModule, passes: Sequence[Pass], label: str) -> fx.GraphModule:
    """Apply ``passes`` in order; the graph after each one is kept in ``gm.meta`` for reports."""
    configure_logs()
    stages = [PassStage.of("captured", gm)]
    for name, graph_pass in passes:
        gm = graph_pass(gm)
        stage = PassStage.of(name, gm)
        log_pass(label, name, dict(stages[-1].op_counts), dict(stage.op_counts), stage.code)
        stages.append(stage)
    gm.meta[STAGES_KEY] = tuple(stages)
    return gm


JOINT_LABEL = "joint graph"


def joint_pipeline(passes: Sequence[Pass]) -> Callable[[fx.GraphModule], fx.GraphModule]:
    """The joint graph's passes as one function for the partitioner; the result is recorded under
    ``JOINT_LABEL`` (its collectives are the forward's and backward's again: reports skip it)."""

    def run(joint: fx.GraphModule) -> fx.GraphModule:
        joint = run_passes(joint, passes, JOINT_LABEL)
        record(JOINT_LABEL, joint, collectives(joint))
        return joint

    return run


def lower_checked(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    label: str,
    lower: Lower,
    world: World,
    options: Options,
) -> Callable[..., Any]:
    """Record the post-pass graph, agree on its collectives across ranks, then compile it."""
    refresh_fake_values(gm, example_inputs)
    found = collectives(gm)
    record(label, gm, found)
    if found and world.backend != "fake":  # a fake group simulates ranks that do not exist
        # Sub-groups of a mesh have a different name on each rank: compare their sizes.
        sizes = {c.group: group_size(c.group) for c in found}
        lines = [c.fingerprint(f"over {sizes[c.group]} ranks") for c in found]
        agree(world, label, lines, options.check_timeout_s)
    return lower(gm, example_inputs)
