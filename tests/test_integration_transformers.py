"""Hugging Face's Trainer trains a dpar model under every strategy to the plain DDP Trainer's numbers.

Two gloo ranks (as torchrun would start them), a tiny HF Llama built from a config, Trainer with
``use_cpu=True, ddp_backend="gloo"``. The anchor is the library's own DDP path: ``transformers.Trainer`` on the
same model and data, which wraps the model in torch DDP. ``DparTrainer`` runs the same arguments with gradient
accumulation, evaluation and ``save_strategy="steps"``; a second DparTrainer resumes from the step-2 checkpoint
(dpar's sharded one) and must end where the uninterrupted runs ended. See [Note: how DparTrainer keeps
Trainer's DDP out] in integrations/transformers.py.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest
import torch
import torch.nn as nn

from distributed import run_ranks

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "tp")
TOLERANCE = 1e-5
STEPS = 3
SAVED_AT = 2
SEQ = 8
VOCAB = 64


def llama() -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    return tf.LlamaForCausalLM(config)


def rows(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Causal-LM examples; the last token of every third row is left out of the loss (a varying token count)."""
    ids = torch.randint(1, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))
    examples = []
    for row, example in enumerate(ids):
        labels = example.clone()
        if row % 3 == 0:
            labels[-1] = -100
        examples.append({"input_ids": example, "labels": labels})
    return examples


def training_arguments(output_dir: str, **changes: object):
    import transformers as tf

    arguments = dict(
        output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True, seed=0,
        per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=1.0,
        logging_steps=1, save_strategy="no",
    )
    return tf.TrainingArguments(**{**arguments, **changes})


def _parallelized(strategy: str) -> nn.Module:
    import dpar

    model = llama()
    if strategy != "ddp":  # ddp is the default of torch.compile(backend="dpar")
        dpar.parallelize(model, strategy=strategy, example_inputs=(rows(2, 0)[0]["input_ids"][None],))
    return model


def _dpar_trainer(strategy: str, output_dir: str):
    from dpar.integrations.transformers import DparTrainer
    from dpar.runtime.gradient_sync import inside_no_sync

    class SyncRecordingTrainer(DparTrainer):
        """Records, per micro-batch, whether its backward reduces (outside ``dpar.no_sync``)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.reduced: list[bool] = []

        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                self.reduced.append(not inside_no_sync(self.model.parameters()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    torch._dynamo.reset()
    model = _parallelized(strategy)
    trainer = SyncRecordingTrainer(
        model, args=training_arguments(output_dir, save_strategy="steps", save_steps=SAVED_AT),
        train_dataset=rows(32, 1), eval_dataset=rows(8, 2),
        compile_options={"compiler": "aot_eager"},
    )
    return model, trainer


def _grad_norms(trainer) -> list[float]:
    """Each step's gradient norm before clipping, as Trainer logs it."""
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _trainer_against_ddp(rank: int, world_size: int, strategy: str, root: str) -> dict[str, object]:
    import dpar
    import transformers as tf

    started = time.monotonic()
    anchor = tf.Trainer(
        model=llama(), args=training_arguments(os.path.join(root, "ddp")), train_dataset=rows(32, 1),
        eval_dataset=rows(8, 2),
    )
    anchor_loss = anchor.train().training_loss
    anchor_eval = anchor.evaluate()["eval_loss"]
    anchor_norms = _grad_norms(anchor)
    want = {k: v.detach().clone() for k, v in anchor.model.state_dict().items()}

    out = os.path.join(root, "dpar")
    model, trainer = _dpar_trainer(strategy, out)
    loss = trainer.train().training_loss
    evaluated = trainer.evaluate()["eval_loss"]
    got = dpar.checkpoint.full_state_dict(model)
    checkpoint = os.path.join(out, f"checkpoint-{SAVED_AT}")
    shard_files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(checkpoint, "dpar", "*.distcp")))

    exported = os.path.join(root, "exported")
    trainer.save_model(exported)

    resumed_model, resumed = _dpar_trainer(strategy, os.path.join(root, "resumed"))
    resumed.train(resume_from_checkpoint=checkpoint)
    got_resumed = dpar.checkpoint.full_state_dict(resumed_model)
    if rank != 0:
        return {}
    from_pretrained = tf.LlamaForCausalLM.from_pretrained(exported).state_dict()
    return {
        "params": _max_diff(want, got),
        "resumed": _max_diff(want, got_resumed),
        "resumed_vs_uninterrupted": _max_diff(got, got_resumed),
        "exported": _max_diff(got, {k: from_pretrained[k] for k in got}),
        "train_loss": abs(loss - anchor_loss),
        "grad_norm": max(abs(a - b) for a, b in zip(_grad_norms(trainer), anchor_norms, strict=True)),
        "anchor_grad_norms": anchor_norms,
        "eval_loss": abs(evaluated - anchor_eval),
        "shard_files": shard_files,
        "reduced": trainer.reduced,
        "seconds": time.monotonic() - started,
    }


# The Trainer's whole loop under the three ways a gradient reaches the optimizer (reduced whole, sharded, split by
# tp); zero1 and zero2 go through it alike and are trained by tests/test_integration_accelerate.py and Lightning's
# (each full Trainer run here costs 1-2 minutes of the suite on two cores).
# fsdp's sharded save and resume under the Trainer: test_load_best_model_at_end below by default; this case's fsdp
# and tp by `-m extended`.
@pytest.mark.parametrize("strategy", ("ddp", pytest.param("fsdp", marks=pytest.mark.extended),
                                      pytest.param("tp", marks=pytest.mark.extended)))
def test_trainer_with_accumulation_evaluation_and_resume_equals_the_ddp_trainer(strategy: str) -> None:
    with tempfile.TemporaryDirectory() as root:
        found = run_ranks(_trainer_against_ddp, 2, strategy, root, timeout_s=300)[0]
    print(f"{strategy}: {found}")
    assert found["shard_files"] == ["__0_0.distcp", "__1_0.distcp"], found  # every rank wrote its own shards
    assert len(found["anchor_grad_norms"]) == STEPS and min(found["anchor_grad_norms"]) > 1.0, found  # clipping acts
    for figure in ("params", "resumed", "resumed_vs_uninterrupted", "train_loss", "eval_loss", "grad_norm"):
        assert found[figure] <= TOLERANCE, (figure, found)
    assert found["exported"] == 0.0, found
    assert found["reduced"] == [False, True] * STEPS, found  # accumulation: one reduction per optimizer step


def test_a_compiled_model_accelerates_torch_compile_and_auto_batch_size_are_refused_by_name() -> None:
    import dpar
    from dpar.integrations.transformers import DparTrainer

    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(dpar.OptionsError, match="already wrapped by torch.compile: pass the model itself"):
            DparTrainer(torch.compile(llama(), backend="dpar"), args=training_arguments(root, ddp_backend=None))
        with pytest.raises(dpar.OptionsError, match="knows no 'dpar' backend: leave torch_compile off"):
            DparTrainer(llama(), args=training_arguments(root, ddp_backend=None, torch_compile=True))
        with pytest.raises(dpar.OptionsError, match="resets the model Trainer runs to the uncompiled one"):
            DparTrainer(llama(), args=training_arguments(root, ddp_backend=None, auto_find_batch_size=True))


def _plain_trainer_around_fsdp(rank: int, world_size: int) -> str:
    """Hugging Face's plain Trainer given a model under fsdp: it wraps the model in torch DDP when it trains."""
    import dpar
    import transformers as tf

    model = llama()
    dpar.parallelize(model, strategy="fsdp")
    with tempfile.TemporaryDirectory() as root:
        trainer = tf.Trainer(model=model, args=training_arguments(root), train_dataset=rows(8, 1))
        try:
            trainer.train()
        except dpar.WrappedTwiceError as e:
            return str(e)
    return "trained"


def test_the_plain_trainer_around_a_model_under_fsdp_is_refused_by_name() -> None:
    for found in run_ranks(_plain_trainer_around_fsdp, 2, timeout_s=300):
        assert found.startswith("a model dpar.parallelize placed is being wrapped in torch.nn.parallel."
                                "DistributedDataParallel"), found
        assert "DparTrainer" in found


def _best_model_against_ddp(rank: int, world_size: int, strategy: str, root: str) -> dict[str, object]:
    import dpar
    import transformers as tf
    from dpar.integrations.transformers import DparTrainer

    # The highest evaluation loss counts as best: not the last checkpoint here, so loading it changes the model.
    best = dict(
        eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=True,
    )
    anchor = tf.Trainer(
        model=llama(), args=training_arguments(os.path.join(root, "ddp"), **best), train_dataset=rows(32, 1),
        eval_dataset=rows(8, 2),
    )
    anchor.train()
    want = {k: v.detach().clone() for k, v in anchor.model.state_dict().items()}
    torch._dynamo.reset()
    model = _parallelized(strategy)
    trainer = DparTrainer(
        model, args=training_arguments(os.path.join(root, "dpar"), **best), train_dataset=rows(32, 1),
        eval_dataset=rows(8, 2), compile_options={"compiler": "aot_eager"},
    )
    trainer.train()
    got = dpar.checkpoint.full_state_dict(model)
    if rank != 0:
        return {}
    return {
        "best": [os.path.basename(t.state.best_model_checkpoint) for t in (anchor, trainer)],
        "params": _max_diff(want, got),
    }


def test_load_best_model_at_end_loads_the_best_sharded_checkpoint_as_the_ddp_trainer_does() -> None:
    with tempfile.TemporaryDirectory() as root:
        found = run_ranks(_best_model_against_ddp, 2, "fsdp", root, timeout_s=300)[0]
    print(found)
    assert found["best"][0] == found["best"][1] != f"checkpoint-{STEPS}", found
    assert found["params"] <= TOLERANCE, found
