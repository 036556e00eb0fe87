"""Each pass on its own, on small graphs whose printed code the assertions read."""

from __future__ import annotations

import torch
import torch.fx as fx

from dpar.compiler.passes.all_reduce import accumulated_gradient_order, all_reduce_gradients_pass
from dpar.compiler.passes.broadcast_buffers import broadcast_buffers_pass
from dpar.compiler.passes.buckets import Gradient, plan_buckets
from dpar.compiler.passes.sink_waits import sink_waits_pass
from fake_world import fake_world


def grad(index: int, numel: int, ready_at: int, dtype: torch.dtype = torch.float32) -> Gradient:
    return Gradient(output_index=index, name=f"p{index}", shape=(numel,), dtype=dtype, ready_at=ready_at)


def test_buckets_fill_in_readiness_order_per_dtype_and_close_at_the_cap() -> None:
    a, b, c = grad(0, 100, ready_at=5), grad(1, 150, ready_at=2), grad(2, 75, ready_at=9)
    d = grad(3, 100, ready_at=7, dtype=torch.bfloat16)
    buckets = plan_buckets([a, b, c, d], cap_bytes=1000)
    # b (600 B) then a (400 B) reach 1000 B and close; d is alone in bf16; c is left open.
    assert [[g.name for g in bucket.gradients] for bucket in buckets] == [["p1", "p0"], ["p3"], ["p2"]]
    assert [bucket.nbytes for bucket in buckets] == [1000, 200, 300]
    assert [bucket.dtype for bucket in buckets] == [torch.float32, torch.bfloat16, torch.float32]


def test_a_gradient_larger_than_the_cap_travels_alone() -> None:
    buckets = plan_buckets([grad(0, 10, 1), grad(1, 1000, 2), grad(2, 10, 3)], cap_bytes=100)
    assert [[g.name for g in b.gradients] for b in buckets] == [["p0", "p1"], ["p2"]]


def backward_like(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple:
    """Stands in for a backward graph: outputs are gradients of (x, w1, w2)."""
    g2 = x * w2
    h = torch.sin(g2)
    g1 = h * w1
    tail = torch.cos(g1)
    return (tail, g1, g2)


def traced() -> fx.GraphModule:
    gm = fx.symbolic_trace(backward_like)
    for node, val in zip(gm.graph.nodes, [torch.ones(4), torch.ones(4), torch.ones(4)]):
        node.meta["val"] = val
    return gm


def ddp_buckets(cap_bytes: int) -> list:
    grads = [grad(1, 4, ready_at=4), grad(2, 4, ready_at=2)]
    return plan_buckets(grads, cap_bytes)


def code_lines(gm: fx.GraphModule) -> list[str]:
    print(gm.code)  # pytest -s shows the graph under test
    return [line.strip() for line in gm.code.splitlines() if "=" in line or "return" in line]


def first(lines: list[str], needle: str) -> int:
    return next(i for i, line in enumerate(lines) if needle in line)


def test_all_reduce_is_issued_after_the_buckets_last_gradient_and_waited_at_once() -> None:
    gm = all_reduce_gradients_pass(traced(), ddp_buckets(cap_bytes=16), group_name="g", world_size=4)
    lines = code_lines(gm)
    # Two 16-byte buckets: w2's gradient (ready first) is reduced before sin runs.
    assert first(lines, "all_reduce") < first(lines, "sin")
    assert first(lines, "div") < first(lines, "all_reduce")
    assert "torch.ops.aten.div.Tensor(view_default, 4)" in gm.code
    assert gm.code.count("all_reduce.default(") == 2
    assert first(lines, "wait_tensor") == first(lines, "all_reduce") + 1  # before sink_waits
    assert lines[-1].startswith("return (cos, view_default_")


def test_sink_waits_moves_each_wait_and_its_views_to_the_first_consumer() -> None:
    gm = all_reduce_gradients_pass(traced(), ddp_buckets(cap_bytes=16), group_name="g", world_size=4)
    lines = code_lines(sink_waits_pass(gm))
    waits = [i for i, line in enumerate(lines) if "wait_tensor" in line]
    assert waits[0] > first(lines, "cos")  # after all compute
    assert [line for line in lines[waits[0]:] if "split_with_sizes" in line]
    assert lines[-1].startswith("return (cos,")


def test_one_bucket_flattens_gradients_into_one_collective() -> None:
    gm = all_reduce_gradients_pass(traced(), ddp_buckets(cap_bytes=1 << 20), group_name="g", world_size=2)
    lines = code_lines(gm)
    assert gm.code.count("all_reduce.default(") == 1
    # Issued right after the bucket's last gradient (mul_1), so it overlaps cos.
    assert first(lines, "mul_1 =") < first(lines, "cat") < first(lines, "all_reduce") < first(lines, "cos")
    assert "split_with_sizes.default(wait_tensor_default, [4, 4])" in gm.code


def test_reduced_gradients_are_averaged_over_ranks() -> None:
    # The fake group's all-reduce returns its input, so what comes back is the pre-division by N.
    with fake_world(4):
        gm = all_reduce_gradients_pass(traced(), ddp_buckets(cap_bytes=1 << 20), group_name="0", world_size=4)
        x, w1, w2 = torch.randn(4), torch.randn(4), torch.randn(4)
        want = backward_like(x, w1, w2)
        got = gm(x, w1, w2)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1] / 4)
    torch.testing.assert_close(got[2], want[2] / 4)


def test_accumulate_variant_adds_the_local_gradients_before_reducing() -> None:
    buckets = ddp_buckets(cap_bytes=1 << 20)
    gm = all_reduce_gradients_pass(traced(), buckets, group_name="0", world_size=2, accumulate=True)
    order = accumulated_gradient_order(buckets)
    assert order == [2, 1]
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["x", "w1", "w2", "accumulated_grad_2", "accumulated_grad_1"]
    with fake_world(2):
        x, w1, w2, acc2, acc1 = (torch.randn(4) for _ in range(5))
        want = backward_like(x, w1, w2)
        got = gm(x, w1, w2, acc2, acc1)
    torch.testing.assert_close(got[1], (want[1] + acc1) / 2)
    torch.testing.assert_close(got[2], (want[2] + acc2) / 2)


def test_buffers_are_read_from_rank_zeros_broadcast() -> None:
    def forward(x: torch.Tensor, mean: torch.Tensor, count: torch.Tensor) -> tuple:
        return (x - mean, count + 1)

    gm = fx.symbolic_trace(forward)
    values = [torch.ones(3), torch.ones(3), torch.ones((), dtype=torch.int64)]
    for node, val in zip(gm.graph.nodes, values):
        node.meta["val"] = val
    gm = broadcast_buffers_pass(gm, [1, 2], group_name="0")
    code_lines(gm)
    assert gm.code.count("broadcast.default(") == 2  # one per dtype
    # The buffers' only reader is the flattening for the broadcast; compute reads the result.
    for name in ("mean", "count"):
        (placeholder,) = [n for n in gm.graph.nodes if n.name == name]
        assert [u.target for u in placeholder.users] == [torch.ops.aten.view.default]
    with fake_world(2):
        out = gm(torch.full((3,), 5.0), torch.full((3,), 2.0), torch.tensor(7))
    torch.testing.assert_close(out[0], torch.full((3,), 3.0))
    assert out[1].item() == 8
