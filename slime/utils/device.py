"""The one place slime decides between CUDA and the CPU.

Asked anew on every call, never cached at import: Ray sets a worker's CUDA_VISIBLE_DEVICES before its task runs,
and a process may import slime earlier than that.
"""

from __future__ import annotations

import torch


def cuda_available() -> bool:
    """Whether this process can use a CUDA GPU."""
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")


def distributed_backend() -> str:
    """The torch.distributed backend for this process: NCCL with CUDA, gloo without."""
    return "nccl" if cuda_available() else "gloo"
