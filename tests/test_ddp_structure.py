"""Structure of the DDP pass in one process with the fake process group at world size 8."""

from __future__ import annotations

import torch
import torch.fx as fx

from dpar.compiler.collectives import collectives
from fake_world import fake_world
from gpt import GPT, GPTConfig

WORLD = 8
MiB = 1024 * 1024


def gpt_backward(bucket_cap_mb: float) -> tuple[GPT, fx.GraphModule]:
    with fake_world(WORLD) as graphs:
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        compiled = torch.compile(model, backend="dpar", options={"compiler": "aot_eager", "bucket_cap_mb": bucket_cap_mb})
        idx = torch.randint(0, 256, (2, 64))
        compiled(idx, idx).backward()
        (backward,) = [g for g in graphs if g.label == "backward graph (sync)"]
        return model, backward.graph


def bucket_sizes(gm: fx.GraphModule) -> list[list[int]]:
    """Per all-reduce, the element counts of the gradients it carries (from its split)."""
    sizes = []
    for node in gm.graph.nodes:
        if node.target is torch.ops._c10d_functional.all_reduce.default:
            (wait,) = node.users
            splits = [u for u in wait.users if u.target is torch.ops.aten.split_with_sizes.default]
            sizes.append(list(splits[0].args[1]))
    return sizes


def gradient_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_one_all_reduce_per_bucket_carrying_every_gradient_byte_once() -> None:
    model, gm = gpt_backward(bucket_cap_mb=1)
    found = [c for c in collectives(gm) if c.kind == "all_reduce"]
    sizes = bucket_sizes(gm)
    assert len(found) == len(sizes) > 1
    assert [c.bytes for c in found] == [4 * sum(s) for s in sizes]
    # Tied embedding / LM head weight: one parameter, one gradient, counted once.
    assert sum(c.bytes for c in found) == gradient_bytes(model)
    assert all(c.dtype == torch.float32 and c.group == found[0].group for c in found)


def test_bucket_cap_gives_the_expected_bucket_counts() -> None:
    model, small = gpt_backward(bucket_cap_mb=1)
    _, large = gpt_backward(bucket_cap_mb=100)
    assert len(bucket_sizes(large)) == 1  # the whole model (~3.3 MB) fits in 100 MB
    cap = 1 * MiB
    buckets = [[4 * n for n in sizes] for sizes in bucket_sizes(small)]
    total = gradient_bytes(model)
    # DDP's rule: a bucket closes once it reaches the cap, so every bucket but the last
    # reaches it, and none reached it before its last gradient.
    for b in buckets[:-1]:
        assert sum(b) >= cap and sum(b) - b[-1] < cap
    largest = max(4 * p.numel() for p in model.parameters())
    assert total // (cap + largest) <= len(buckets) <= -(-total // cap)
    assert len(buckets) == 4, [sum(b) for b in buckets]


HEAVY = ("mm", "bmm", "embedding_dense_backward", "native_layer_norm_backward", "_scaled_dot_product")


def test_each_all_reduce_is_issued_before_the_backward_compute_it_overlaps() -> None:
    _, gm = gpt_backward(bucket_cap_mb=1)
    nodes = list(gm.graph.nodes)
    heavy = [i for i, n in enumerate(nodes) if n.op == "call_function" and str(n.target).startswith(
        tuple(f"aten.{h}" for h in HEAVY))]
    found = [c for c in collectives(gm) if c.kind == "all_reduce"]
    at = {n.name: i for i, n in enumerate(nodes)}
    for c in found[:-1]:
        # Issued while heavy backward compute remains; the last bucket has only the tail left.
        assert at[c.issue_node] < heavy[-1]
        assert sum(at[c.issue_node] < i for i in heavy) > 0
    for c in found:
        assert at[c.wait_node] > heavy[-1]  # every wait sits after all the backward compute
    # Earlier buckets overlap more compute than later ones.
    overlapped = [sum(at[c.issue_node] < i for i in heavy) for c in found]
    assert overlapped == sorted(overlapped, reverse=True) and overlapped[0] > 10
