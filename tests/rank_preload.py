"""What the rank processes import, imported once in the server they fork from (``distributed.RANK_CONTEXT``).

Importing is all this does: nothing here runs a graph, starts a thread or touches a process group, so a fork of
it is a fresh rank. Hugging Face's model code is imported where it is installed (.ci/run's newest-torch stage has
none; the forkserver ignores a preload that fails to import, but this one must not fail for that).
"""

import torch
import torch._dynamo
import torch._functorch.aot_autograd
import torch.distributed
import torch.distributed.tensor

import dpar

try:
    from transformers.models import bert, gpt2, llama, mixtral, t5  # noqa: F401
except ImportError:
    pass
