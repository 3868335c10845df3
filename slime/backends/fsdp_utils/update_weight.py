"""What the FSDP backend sends to the engines on a weight update: its full parameters under HF names.

Each FSDP-sharded parameter is gathered to a full tensor with `DTensor.full_tensor()`, a collective
every training rank joins, so every rank iterates the buckets to the end. The transports and the
engine protocol are backend-neutral and live in `slime.backends.weight_sync`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils.model import reshard
from slime.utils.weight_sync import Bucket, bucket_named_tensors


def full_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full contiguous parameter on the training device), a collective over the FSDP group.

    Args:
        model: The FSDP-sharded causal LM (tied parameters appear once, under their first name).
        dtype: Cast to this dtype (None keeps the parameter dtype).
    """
    reshard(model)
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, full.detach().to(dtype or full.dtype).contiguous()


def full_parameter_buckets(model: nn.Module, buffer_size: int, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """`full_parameters` in buckets of at most `buffer_size` bytes (`--update-weight-buffer-size`)."""
    return bucket_named_tensors(full_parameters(model, dtype), buffer_size)
