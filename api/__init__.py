"""dpar: a graph-level parallelization backend for torch.compile.

``import dpar`` registers ``backend="dpar"``; the installed entry point does too.
"""

from dpar.compiler.backend import dpar_backend, register
from dpar.explaining import explain
from dpar.compiler.logs import configure as _configure_logs
from dpar.initialization import init_weights
from dpar.pipelining import pipeline
from dpar.placement import parallelize
from dpar.planning import Plan, plan
from dpar.runtime import checkpoint
from dpar.core.plan import ActivationPolicy, Recompute
from dpar.core.errors import (
    ActivationPolicyError, BatchMismatchError, CheckpointError, CollectiveMismatchError, ContextParallelError,
    CollectiveStallError, DivergedRanksError, DparError,
    InitializationError, InspectionError, NonFiniteGradientError, NotCompiledError, OptionsError, PipelineAdviceWarning, PipelineMemoryError, PlanMemoryError, ProcessGroupError, RankLostError,
    SafetensorsCheckpointError, ScheduleError, TensorParallelPlanError, TooFewBlocksError, TooFewMicroBatchesError,
    UnmaterializedStateError, WrappedTwiceError,
)
from dpar.compiler.pipeline_parallel.schedules import PipelineBubbleWarning
from dpar.runtime.gradient_sync import no_sync
from dpar.runtime.gradient_norm import clip_grad_norm_
from dpar.core.facts import OuterSGD

register()
_configure_logs()  # DPAR_LOGS applies from the first compile on

__all__ = [
    "ActivationPolicy",
    "ActivationPolicyError",
    "BatchMismatchError",
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveStallError",
    "ContextParallelError",
    "DivergedRanksError",
    "DparError",
    "InitializationError",
    "InspectionError",
    "NonFiniteGradientError",
    "NotCompiledError",
    "OptionsError",
    "OuterSGD",
    "PipelineAdviceWarning",
    "PipelineBubbleWarning",
    "PipelineMemoryError",
    "Plan",
    "PlanMemoryError",
    "ProcessGroupError",
    "RankLostError",
    "Recompute",
    "SafetensorsCheckpointError",
    "ScheduleError",
    "TensorParallelPlanError",
    "TooFewBlocksError",
    "TooFewMicroBatchesError",
    "UnmaterializedStateError",
    "WrappedTwiceError",
    "checkpoint",
    "clip_grad_norm_",
    "dpar_backend",
    "explain",
    "init_weights",
    "no_sync",
    "parallelize",
    "pipeline",
    "plan",
]
