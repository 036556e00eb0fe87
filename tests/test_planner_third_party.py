"""Planning models this project did not write: Hugging Face ModelOutputs, caches, graph breaks.

See [Note: what the planner captures of a model's outputs] in ``planner/capture.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dpar
from dpar.planner.capture import build_op_graph
from dpar.planning import plan

pytest.importorskip("transformers")
from third_party import build, global_batch  # noqa: E402  (needs transformers)

ROWS = 4


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_hugging_face_causal_lm_plans_from_ids_alone(name: str) -> None:
    """Called as ``model(ids)``: a ModelOutput holding a DynamicCache, which export cannot return."""
    model = build(name).inner
    ids, _, _ = global_batch(0, ROWS)
    p = plan(model, (ids,), mesh_shape=(2,))
    assert [pp.name for pp in p.parameters] == [n for n, _ in model.named_parameters()]
    assert p.batch_size == ROWS
    assert any(o.module == "lm_head" and o.kind == "linear" for o in p.ops)
    # use_cache=False: the logits are the only output, no key/value tensor is.
    [output] = [op for op in build_op_graph(model, (ids,)).ops if op.kind == "output"]
    assert output.input_shapes == ((ROWS, ids.shape[1], model.config.vocab_size),)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_hugging_face_model_returning_its_loss_plans(name: str) -> None:
    """As the tests train them: (ids, labels, attention mask) in, ``.loss`` out."""
    model = build(name)
    p = plan(model, global_batch(0, ROWS), mesh_shape=(2,))
    assert [pp.name for pp in p.parameters] == [n for n, _ in model.named_parameters()]
    assert "data split over:" in str(p)


class Chatty(nn.Module):
    """What makes Dynamo break the graph (a print, an explicit break) and a return value export rejects."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = F.gelu(self.up(x))
        print("hidden", tuple(h.shape))
        torch._dynamo.graph_break()
        return {"out": self.down(h), "note": object(), "rows": x.shape[0]}


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 2 if y.sum() > 0 else y


def test_a_branch_on_a_tensor_value_names_the_fix() -> None:
    with pytest.raises(dpar.OptionsError, match=r"the forward branches on a tensor's value .* torch.where or torch.cond"):
        plan(Branchy(), (torch.randn(8, 16),), mesh_shape=(2,))


def test_python_that_breaks_the_graph_and_non_tensor_outputs_plan(capsys) -> None:
    p = plan(Chatty(), (torch.randn(8, 16),), mesh_shape=(2,))
    assert [pp.name for pp in p.parameters] == ["up.weight", "up.bias", "down.weight", "down.bias"]
    assert "hidden (8, 64)" in capsys.readouterr().out


def test_ropes_concatenation_keeps_heads_split_under_tensor_parallel() -> None:
    """RoPE's rotate_half joins the halves of each head (``cat((-x2, x1), -1)`` of [batch, heads, seq, head_dim]):
    under tp each rank joins its own heads', as attention reads them split. Without that rule every layer
    all-gathered q and k before RoPE and ran attention replicated over the tp group."""
    from dpar.compiler.costs import PRESETS
    from dpar.planner.evaluate import evaluate
    from dpar.planner.strategies import strategy_assignment

    model = build("llama")
    graph = build_op_graph(model, global_batch(0, ROWS))
    concats = [op for op in graph.ops if op.kind == "concat"]
    assert concats and all(len(op.output_shape) == 4 for op in concats)
    planned = evaluate(graph, strategy_assignment(graph, "ddp+tp", (2, 2)), PRESETS["h100"])
    assert {o.choice for o in planned.ops if o.kind in ("concat", "attention")} == {"shard"}
    assert not [c for c in planned.collectives if c.mesh_dim == "tp" and c.phase == "forward" and "cat" in c.where]
