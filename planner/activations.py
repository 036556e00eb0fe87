"""What each op saves for the backward, and what it recomputes, under an activation policy.

[Note: pricing recomputation]
A block is one instance of a numbered module (``layers.3``), the notion ``planner/repeats.py``
collapses repeated layers by; ops outside every block (embeddings, the final norm, the head,
the loss) always keep their activations. The cost model (``planner/costs.py``) counts, for
every op a gradient flows through, its output as saved until the backward (bf16, split over
dp by the batch and over tp when the output is ``S``): that is ``KEEP``. The other policies
change two numbers per op, both on one rank and times the op's repeat count:

* ``SELECTIVE`` (torchtitan's op-level policy): a block saves its input and the outputs of
  its matmuls (``linear``, ``matmul``, ``attention``); the cheap ops between them (pointwise,
  norms, softmax, ...) are recomputed in the backward. Their saved bytes are dropped and
  their forward time is added to the backward.
* ``FULL``: a block saves only its input; its whole forward runs again in its backward.
  Every op of the block drops its saved bytes and adds its forward time.

In both, a block's output (what an op outside its own instance reads: the next block's
input, the final norm's) stays saved: it is the next block's checkpoint (SELECTIVE does not
recompute it either; FULL does, as part of the block's forward). While one block's
backward runs, its recomputed activations are live again on top of every checkpoint: memory
adds the largest single instance's dropped bytes (``live``), a max the ILP takes as one
variable bounded below by each instance's sum. Sharded parameters are not gathered again for
the recomputation: fsdp's backward all-gather, which the cost model already prices, brings
the block's parameters before the recomputed forward needs them, and zero2 keeps them whole.

Collectives are never recomputed (as ``compiler/passes/recompute.py`` applies the policy):
a forward tensor-parallel conversion (the all-reduce after a row Linear, an all-gather)
whose consumer is recomputed keeps its result saved instead, so those bytes are added back
(one per edge and candidate pair, on the ILP's edge variables). Random ops (dropout), which that
pass saves rather than replays, are priced as recomputed: the op graph does not tell them
from other pointwise ops.

The added time lands in the backward, so it also hides more of the backward's
data-parallel collectives (``exposed = max(0, dp_bwd - compute_bwd - recompute)``); the step
is ``compute + recompute + exposed comm``. For one assignment KEEP is never slower, so a
policy that recomputes wins only where the memory budget rules out the faster placements
without it (``solver.solve_activations``), and between two policies the fewest blocks under
the heavier one that fit ([Note: mixing policies across blocks]).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from dpar.compiler.costs import DeviceSpec
from dpar.core.plan import ActivationPolicy, Recompute
from dpar.planner.costs import CostModel, OpCost
from dpar.planner.evaluate import Assignment, chosen
from dpar.planner.opgraph import Edge, OpGraph
from dpar.planner.plan import Plan
from dpar.planner.repeats import instance_of
from dpar.planner.rules import FORWARD_CONVERT, Candidate

POLICIES = (Recompute.KEEP, Recompute.SELECTIVE, Recompute.FULL)  # least recomputation first: the tie-break order
SAVED_KINDS = frozenset({"linear", "matmul", "attention", "embedding"})  # what SELECTIVE keeps inside a block


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Which block instance each op of the (collapsed) graph belongs to, and which ops' outputs leave their block."""

    of_op: tuple[str | None, ...]  # "layers.3" (the representative instance), None: outside every block
    leaves: tuple[bool, ...]  # an op outside the op's own instance reads its output: a checkpoint under recomputation

    @property
    def instances(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = defaultdict(list)
        for o, block in enumerate(self.of_op):
            if block is not None:
                found[block].append(o)
        return dict(found)


def blocks(graph: OpGraph) -> Blocks:
    of_op = []
    for op in graph.ops:
        found = instance_of(op.module) if op.kind != "output" else None
        of_op.append(None if found is None else f"{found[0]}.{found[1]}" if found[0] else str(found[1]))
    leaves = [False] * len(graph.ops)
    for e in graph.edges:
        if of_op[e.src] is not None and of_op[e.dst] != of_op[e.src]:
            leaves[e.src] = True
    return Blocks(tuple(of_op), tuple(leaves))


def policy(recompute: Recompute) -> ActivationPolicy:
    """The plan's policy: ``recompute`` for every block (the planner chooses one for the whole model)."""
    return ActivationPolicy(default=recompute)


class ActivationModel:
    """Saved bytes and recompute seconds of each op under one policy, on one layout (see the Note)."""

    def __init__(self, graph: OpGraph, model: CostModel, recompute: Recompute, found: Blocks | None = None) -> None:
        self.graph, self.model, self.recompute = graph, model, recompute
        self.blocks = found or blocks(graph)

    def kept(self, o: int, cand: Candidate) -> float:
        """Bytes op ``o`` saves under KEEP (what ``CostModel.op_cost`` counts in its memory)."""
        op = self.graph.ops[o]
        if not op.needs_grad or op.kind == "output":
            return 0.0
        return op.count * self.model.saved_bytes(o, cand)

    def recomputed(self, o: int) -> bool:
        """Op ``o`` runs again in the backward: under FULL its whole block; under SELECTIVE the cheap ops whose outputs
        are not saved (a block's output is: it is the next block's checkpoint)."""
        if self.blocks.of_op[o] is None or self.recompute is Recompute.KEEP:
            return False
        return self.recompute is Recompute.FULL or (self.graph.ops[o].kind not in SAVED_KINDS and not self.blocks.leaves[o])

    def saved(self, o: int, cand: Candidate) -> float:
        """Bytes op ``o`` saves under this policy: its KEEP bytes unless recomputed and not a block's output."""
        return 0.0 if self.recomputed(o) and not self.blocks.leaves[o] else self.kept(o, cand)

    def live(self, o: int, cand: Candidate) -> float:
        """Bytes op ``o``'s recomputation holds again while one instance of its block runs its backward."""
        return (self.kept(o, cand) - self.saved(o, cand)) / self.graph.ops[o].count

    def memory(self, o: int, cand: Candidate, cost: OpCost) -> float:
        """``cost.memory`` (state + KEEP's saved bytes) with this policy's saved bytes instead."""
        return cost.memory - self.kept(o, cand) + self.saved(o, cand)

    def seconds(self, o: int, cost: OpCost) -> float:
        """Forward time op ``o`` adds to the backward."""
        return cost.compute_fwd if self.recomputed(o) else 0.0

    def converted(self, e: Edge, src: Candidate, dst: Candidate) -> float:
        """Bytes of edge ``e``'s forward tp conversion result kept for a recomputed consumer (0 without one, and for
        the token stream gathered from its sequence-parallel shards: the backward gathers it again)."""
        wanted = dst.inputs[e.position]
        if not self.recomputed(e.dst) or FORWARD_CONVERT.get((src.output, wanted)) is None or src.output == "Q":
            return 0.0
        src_op = self.graph.ops[e.src]
        kept = "Q" if wanted == "Q" else "R"  # a collective's output (a reduce-scatter's is the shard)
        return e.count * self.model.activation_bytes(e.numel, src_op.batched, kept, src_op.output_itemsize)

    def total(self, picked: list[Candidate], costs: list[OpCost] | None = None) -> tuple[float, float]:
        """(memory, of which saved activations) per rank under one assignment: what the ILP's memory row sums."""
        costs = costs or [self.model.op_cost(o, c) for o, c in enumerate(picked)]
        extra = self.peak(picked) + sum(self.converted(e, picked[e.src], picked[e.dst]) for e in self.graph.edges)
        memory = sum(self.memory(o, c, cost) for o, (c, cost) in enumerate(zip(picked, costs)))
        return memory + extra, sum(self.saved(o, c) for o, c in enumerate(picked)) + extra

    def peak(self, picked: list[Candidate]) -> float:
        """The largest instance's live bytes under one assignment."""
        by_block: dict[str, float] = defaultdict(float)
        for o, cand in enumerate(picked):
            if self.blocks.of_op[o] is not None:
                by_block[self.blocks.of_op[o]] += self.live(o, cand)
        return max(by_block.values(), default=0.0)


@dataclasses.dataclass(frozen=True)
class Priced:
    """One assignment's totals under one policy, on one rank."""

    memory: float  # state + saved activations + the live block
    activations: float  # saved activations + the live block
    recompute_s: float
    exposed_s: float  # tp, ep and cp comm + unhidden dp comm
    step_s: float  # compute + recompute + exposed


def price(graph: OpGraph, model: CostModel, picked: list[Candidate], recompute: Recompute, compute_s: float,
          critical_comm_s: float) -> Priced:
    """Totals of ``picked`` (``compute_s`` and ``critical_comm_s``, the tp, ep and cp collectives, as ``evaluate``
    priced them, under KEEP) under ``recompute``."""
    acts = ActivationModel(graph, model, recompute)
    costs = [model.op_cost(o, c) for o, c in enumerate(picked)]
    memory, saved = acts.total(picked, costs)
    recompute_s = sum(acts.seconds(o, cost) for o, cost in enumerate(costs))
    exposed = critical_comm_s + model.exposed_dp(costs, recompute_s)
    return Priced(memory, saved, recompute_s, exposed, compute_s + recompute_s + exposed)


def with_policy(plan: Plan, graph: OpGraph, assignment: Assignment, device: DeviceSpec, recompute: Recompute) -> Plan:
    """``plan`` (``evaluate``'s, which keeps every activation) under ``recompute``: memory, recompute time and step."""
    model = CostModel(graph, assignment.layout, device)
    c = plan.cost
    priced = price(graph, model, chosen(graph, assignment), recompute, c.compute_s, c.critical_comm_s)
    cost = dataclasses.replace(
        c,
        exposed_comm_s=priced.exposed_s,
        step_s=priced.step_s,
        memory_bytes_per_rank=round(priced.memory),
        activation_bytes_per_rank=round(priced.activations),
        recompute_s=priced.recompute_s,
        memory_bytes_keep=c.memory_bytes_per_rank,
        activation_bytes_keep=c.activation_bytes_per_rank,
    )
    return dataclasses.replace(plan, cost=cost, activations=policy(recompute))


def fewest_blocks(
    plan: Plan, graph: OpGraph, assignment: Assignment, device: DeviceSpec, budget: float,
    lighter: Recompute = Recompute.SELECTIVE, heavier: Recompute = Recompute.FULL,
) -> Plan | None:
    """On ``assignment``, the fewest blocks under ``heavier``, the others under ``lighter``, that fit ``budget``;
    None when none but all of them do (or the blocks cannot be told apart).

    [Note: mixing policies across blocks]
    Full recomputation of every block fits where selective does not, at the price of every
    block's forward (and selective where keep does not, at the price of the cheap ops). Between
    two such policies, the first k blocks (in model order) under the heavier one and the rest
    under the lighter: memory falls with k (each heavier block saves more, beyond the largest
    recomputed block, which is counted once) and the step grows with it (compute +
    max(recompute, comm) never shrinks as recompute grows), so the smallest k that fits is the
    fastest of them on these placements. With blocks collapsed into representatives
    (``planner/repeats.py``) an op stands for ``count`` instances: a representative with
    ``k_b`` of its instances under the heavier policy counts ``k_b / count`` of its bytes and
    seconds and the rest of the lighter's. Torchtitan checkpoints every n-th block for the same
    trade; here the policy names the blocks.
    """
    model = CostModel(graph, assignment.layout, device)
    picked = chosen(graph, assignment)
    costs = [model.op_cost(o, c) for o, c in enumerate(picked)]
    found = blocks(graph)
    light, heavy = (ActivationModel(graph, model, r, found) for r in (lighter, heavier))
    instances = _real_instances(graph, found)
    if instances is None or len(instances) < 2:
        return None
    per_instance: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # rep block -> (bytes saved, seconds added)
    live: dict[str, dict[Recompute, float]] = defaultdict(lambda: defaultdict(float))
    for o, (cand, cost) in enumerate(zip(picked, costs)):
        block = found.of_op[o]
        if block is None:
            continue
        n = graph.ops[o].count
        per_instance[block][0] += (light.saved(o, cand) - heavy.saved(o, cand)) / n
        per_instance[block][1] += (heavy.seconds(o, cost) - light.seconds(o, cost)) / n
        live[block][lighter] += light.live(o, cand)
        live[block][heavier] += heavy.live(o, cand)
    for e in graph.edges:
        block = found.of_op[e.dst]
        if block is not None:
            per_instance[block][0] += (light.converted(e, picked[e.src], picked[e.dst])
                                       - heavy.converted(e, picked[e.src], picked[e.dst])) / e.count
    memory_light, _ = light.total(picked, costs)
    base = memory_light - light.peak(picked)
    recompute_light = sum(light.seconds(o, cost) for o, cost in enumerate(costs))
    counts = {b: sum(1 for _, rep in instances if rep == b) for b in per_instance}
    for k in range(1, len(instances)):
        taken: dict[str, int] = defaultdict(int)
        for _, rep in instances[:k]:
            taken[rep] += 1
        peak = max(
            max(live[b][heavier] if taken[b] else 0.0, live[b][lighter] if taken[b] < counts[b] else 0.0)
            for b in per_instance
        )
        memory = base - sum(taken[b] * per_instance[b][0] for b in taken) + peak
        if memory > budget:
            continue
        recompute_s = recompute_light + sum(taken[b] * per_instance[b][1] for b in taken)
        policy_k = ActivationPolicy(lighter, tuple((name, heavier) for name, _ in instances[:k]))
        return _with_totals(plan, policy_k, model, costs, memory, recompute_s, found, picked)
    return None


def _real_instances(graph: OpGraph, found: Blocks) -> list[tuple[str, str]] | None:
    """(block path, its representative) for every block instance of the model, in model order, from the buckets of
    the parameters (``layers.7`` -> the representative block whose op reads its parameters); None when some block
    has no parameter to tell it by, or the counts do not match the representatives'."""
    rep_of: dict[str, str] = {}
    for p in graph.params:
        if p.op is not None and p.bucket not in (None, "root") and found.of_op[p.op] is not None:
            rep_of.setdefault(p.bucket.lstrip("."), found.of_op[p.op])  # ".3": block 3 of an nn.Sequential root
    instances = list(rep_of.items())
    for block, ops in found.instances.items():
        if sum(1 for _, rep in instances if rep == block) != graph.ops[ops[0]].count:
            return None
    return instances


def _with_totals(
    plan: Plan, activations: ActivationPolicy, model: CostModel, costs: list[OpCost], memory: float,
    recompute_s: float, found: Blocks, picked: list[Candidate],
) -> Plan:
    c = plan.cost
    state = sum(cost.memory for cost in costs) - sum(
        ActivationModel(model.graph, model, Recompute.KEEP, found).kept(o, cand) for o, cand in enumerate(picked))
    exposed = c.critical_comm_s + model.exposed_dp(costs, recompute_s)
    keep_memory = c.memory_bytes_keep if c.memory_bytes_keep is not None else c.memory_bytes_per_rank
    keep_acts = c.activation_bytes_keep if c.activation_bytes_keep is not None else c.activation_bytes_per_rank
    cost = dataclasses.replace(
        c, exposed_comm_s=exposed, step_s=c.compute_s + recompute_s + exposed, memory_bytes_per_rank=round(memory),
        activation_bytes_per_rank=round(memory - state), recompute_s=recompute_s, memory_bytes_keep=keep_memory,
        activation_bytes_keep=keep_acts,
    )
    return dataclasses.replace(plan, cost=cost, activations=activations)
