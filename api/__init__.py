"""dpar: a graph-level parallelization backend for torch.compile.

``import dpar`` registers ``backend="dpar"``; the installed entry point does too.
"""

from dpar.compiler.backend import dpar_backend, register
from dpar.runtime.errors import CollectiveMismatchError, DparError, OptionsError, ProcessGroupError
from dpar.runtime.gradient_sync import no_sync

register()

__all__ = [
    "CollectiveMismatchError",
    "DparError",
    "OptionsError",
    "ProcessGroupError",
    "dpar_backend",
    "no_sync",
]
