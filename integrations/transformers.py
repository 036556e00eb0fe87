"""dpar under Hugging Face's ``Trainer``: its loop, accumulation, evaluation and checkpoints, with dpar reducing.

[Note: how DparTrainer keeps Trainer's DDP out]
``Trainer`` documents two attributes: ``model``, the core model, and ``model_wrapped``, "the most external
model", the one forward and backward run through. When ``model_wrapped`` already differs from ``model``,
Trainer takes the model as wrapped and asks Accelerate to prepare only the optimizer, so no torch DDP goes
around it (see [Note: why Accelerate must not wrap a dpar model] in ``accelerate.py``). ``DparTrainer``
keeps ``model`` the user's (parallelized) model, so saving, the signature columns and the loss
arguments read it as usual, and sets ``model_wrapped`` to ``torch.compile(model, backend="dpar")``.
Evaluation prepares the core model without wrapping it; ``prediction_step`` then runs the compiled one,
since under the sharded strategies only the compiled graphs gather the parameters.

Gradient accumulation: Trainer marks each micro-batch that does not step (``accelerator.sync_gradients``
is False) and enters ``accelerator.no_sync(model)``, which finds no DDP and does nothing; ``training_step``
runs those micro-batches inside ``dpar.no_sync``, so the gradients are reduced once per step, as DDP does.

Checkpoints are dpar's, sharded: each ``checkpoint-N`` holds ``dpar/`` (``dpar.checkpoint.save`` of the model
and the optimizer, every rank writing its shards) beside Trainer's scheduler, per-rank RNG states and
``trainer_state.json``; ``resume_from_checkpoint`` reads them back at any world size the strategy allows.
``save_model`` (the user's, not a checkpoint's) exports a directory ``from_pretrained`` opens
(``dpar.checkpoint.save_safetensors``). The hooks Trainer has no public name for (``_save_optimizer_and_scheduler``,
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_best_model``, and ``_clip_grad_norm``, see
``dpar.clip_grad_norm_``) are overridden by those names; tests/test_integration_transformers.py
resumes, loads the best model and compares the clipped norms through each, so a rename in transformers fails
there, never silently.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
import transformers

import dpar
from dpar.integrations.accelerate import compile_with_dpar

CHECKPOINT_SUBDIR = "dpar"  # inside each checkpoint-N: dpar.checkpoint's sharded model and optimizer


class DparTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a model dpar trains: pass the model (after ``dpar.parallelize`` for a strategy
    other than ddp) and, optionally, ``compile_options`` for ``torch.compile(..., backend="dpar", options=...)``.

    See [Note: how DparTrainer keeps Trainer's DDP out].
    """

    def __init__(
        self, model: nn.Module, *args: Any, compile_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        compiled = compile_with_dpar(model, compile_options)
        super().__init__(model, *args, **kwargs)
        if self.args.torch_compile:
            raise dpar.OptionsError(
                "TrainingArguments(torch_compile=True) compiles through Accelerate, which knows no 'dpar' backend: "
                "leave torch_compile off; DparTrainer compiles the model with backend='dpar' "
                "(its options: DparTrainer(..., compile_options={...}))"
            )
        if self.args.auto_find_batch_size:  # every try resets model_wrapped to the core model, which DDP wraps
            raise dpar.OptionsError(
                "TrainingArguments(auto_find_batch_size=True) resets the model Trainer runs to the uncompiled one, "
                "in torch DDP, at every try: set per_device_train_batch_size instead"
            )
        self.model_wrapped = compiled
        self.compiled_model = compiled

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self.accelerator.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with dpar.no_sync(self.model):
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return super().prediction_step(self.compiled_model, inputs, prediction_loss_only, ignore_keys)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # Trainer's clip reads a tensor-parallel block as a whole gradient: see dpar.clip_grad_norm_.
        self.accelerator.unscale_gradients()
        return dpar.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A checkpoint's model goes to dpar's sharded checkpoint (with the optimizer); the user's call exports
        a Hugging Face directory. Every rank calls it, as Trainer does."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:
            optimizer = None if self.args.save_only_model else _torch_optimizer(self.optimizer)
            dpar.checkpoint.save(self.model, optimizer, os.path.join(output_dir, CHECKPOINT_SUBDIR))
            return
        dpar.checkpoint.save_safetensors(self.model, output_dir, config=getattr(self.model, "config", None))
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The optimizer is in dpar's checkpoint (save_model above); Trainer's own writes only rank 0's state.
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing yet: Trainer calls this before the optimizer exists, and dpar's checkpoint holds the weights
        with the optimizer state, read once in ``_load_optimizer_and_scheduler`` (which names what is missing)."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer = None if self.args.save_only_model else _torch_optimizer(self.optimizer)
        dpar.checkpoint.load(self.model, optimizer, os.path.join(checkpoint, CHECKPOINT_SUBDIR))
        scheduler_file = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        best = os.path.join(self.state.best_model_checkpoint, CHECKPOINT_SUBDIR)
        dpar.checkpoint.load(self.model, None, best)


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (whose state is the inner one's)."""
    return getattr(optimizer, "optimizer", optimizer)
