"""The errors dpar raises, each naming the problem and the fix.

They derive from Dynamo's ``ShortenTraceback`` because Dynamo re-raises that
family unchanged instead of wrapping it in ``BackendCompilerFailed``: a user
catches ``dpar.CollectiveMismatchError`` (or the ``ValueError`` of a bad option)
exactly as raised.
"""

from __future__ import annotations

from dpar.core.torch_internals import ShortenTraceback



class DparError(ShortenTraceback):
    """The base of every error dpar raises; each message names the problem and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message, first_useful_frame=None)


class OptionsError(DparError, ValueError):
    """An option or argument has a value dpar cannot use."""


class TensorParallelPlanError(OptionsError):
    """A tensor-parallel plan splits a parameter that an op reads whole: sharding propagation has no
    rule that keeps its block there (a convolution, BatchNorm, a grouped expert matmul); or, under
    ``dpar.pipeline``, a tp degree that does not divide a split layer's heads, or a plan naming a
    parameter no stage reads."""


class ContextParallelError(OptionsError):
    """Context parallel cannot split this model's sequences exactly: a sequence not divisible into two
    chunks per rank, or an attention kernel (or a mask gradient) the context-parallel pass does not follow."""


class ActivationPolicyError(OptionsError):
    """An activation-checkpointing policy dpar cannot apply: an unknown policy, a block the model does
    not have, a model without numbered blocks, or checkpointing where it is not supported yet."""


class ProcessGroupError(DparError):
    """torch.distributed is not set up the way the launch or the model needs."""


class CollectiveMismatchError(DparError):
    """Ranks are about to issue different collective sequences, or hold different state."""


class DivergedRanksError(CollectiveMismatchError):
    """Another rank waits inside collectives this rank will not issue: it runs a graph this rank does not."""


class CollectiveStallError(CollectiveMismatchError):
    """Every rank is alive, yet one waits for a collective that every peer has issued and none completes:
    it was paired with another collective (issued in another order, or on some ranks only) or lost."""


class BatchMismatchError(DparError):
    """Ranks that the user said are fed the same rows were fed different ones."""


class CheckpointError(DparError, ValueError):
    """A checkpoint cannot be used as asked: unpublished, damaged, another model's, or another layout's."""


class SafetensorsCheckpointError(CheckpointError):
    """A Hugging Face safetensors checkpoint does not fit the model it is loaded into (a tensor missing or
    unexpected, another shape or dtype, a shard file absent or unreadable), or could not be written."""


class ScheduleError(DparError):
    """A pipeline schedule would hang or compute the wrong thing: an action that can never run."""


class RankLostError(DparError):
    """A rank of the job vanished (killed, crashed, its host lost) in the middle of training."""


class NonFiniteGradientError(DparError, FloatingPointError):
    """A backward produced nan or inf gradients (raised under options={"check_finite": True})."""


class PlanMemoryError(OptionsError):
    """No placement plan (every layout, every activation policy) fits the model in the memory budget."""


class PipelineMemoryError(OptionsError):
    """No pipeline degree fits the model's state and activations in the memory budget."""


class TooFewMicroBatchesError(OptionsError):
    """A pipeline schedule's order needs more micro-batches than it was given (interleaved 1F1B runs them in
    rounds of the pipeline's ranks)."""


class TooFewBlocksError(OptionsError):
    """A pipeline needs more stages than the model has blocks to cut between (ZBV: two stages on every rank)."""


class InitializationError(DparError):
    """``dpar.init_weights`` cannot replay an initializer as on one device: it writes where the full-size
    stand-ins cannot reach (a reference taken before ``parallelize``), or the ranks' random generators differ."""


class UnmaterializedStateError(DparError):
    """A model built on the meta device reaches training with a parameter or buffer never given values:
    still on meta, or left as ``to_empty``'s uninitialized memory."""


class WrappedTwiceError(DparError):
    """A dpar-compiled model also wrapped by another data-parallel wrapper (torch DDP, FSDP2's
    ``fully_shard``): both would synchronise gradients, so every one would be reduced twice."""


# What a WrappedTwiceError about torch DDP advises (compiler/wrapped_twice.py, surgery/sharding.py).
LEAVE_DDP_OUT = (
    "dpar already inserts the gradient all-reduce (or reduce-scatter) into the compiled graphs, so every "
    "gradient would be reduced twice. Give the compiled model to the training loop unwrapped: drop a "
    "hand-written DistributedDataParallel(model); a library that wraps models in DDP when run under "
    "torchrun must be told the model is distributed already: with Hugging Face's Trainer use "
    "dpar.integrations.transformers.DparTrainer, with Accelerate dpar.integrations.accelerate.DparAccelerator, "
    "with Lightning dpar.integrations.lightning's strategies (they compile with dpar and wrap nothing)"
)


class NotCompiledError(DparError):
    """A parallelized model ran a training forward outside dpar's compiled graphs: dpar's communication
    lives in those graphs, so each rank would train on its own gradients."""


class InspectionError(DparError):
    """``dpar.explain`` / ``dpar inspect`` captured graphs that cannot be what training runs: a report
    on them would be wrong (a data-parallel backward with no gradient reduction)."""


class StepNotCaptured(Exception):
    """Dynamo cannot capture an optimizer's step whole; ``reason`` is the first line of why. Not a user's
    error: the compiler's optimizer stage raises it, the runtime's optimizer hooks then step eagerly and warn."""

    def __init__(self, optimizer: object, reason: str) -> None:
        super().__init__(f"Dynamo cannot capture {type(optimizer).__name__}'s step: {reason}")
        self.reason = reason


class PipelineAdviceWarning(UserWarning):
    """``parallelize(strategy="auto")`` applied placements where the planner's fastest answer is a pipeline,
    which ``dpar.pipeline(plan=...)`` runs."""
