"""What the Megatron backend sends to the engines on a weight update: its weights under HF names.

Each parameter is gathered over tensor (and expert) parallelism and converted to its HF names by
`megatron_to_hf.megatron_state_to_hf` (a collective every rank of the stage joins), so every rank
holds full tensors and no extra data-parallel traffic is needed. The transports and the engine
protocol are backend-neutral and live in `slime.utils.weight_sync`. Pipeline parallelism is not
handled here yet: `update_weights` refuses it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from slime.backends.megatron_utils.megatron_to_hf import megatron_state_to_hf
from slime.utils.weight_sync import Bucket, bucket_named_tensors


def hf_weights(
    model: list[nn.Module], family: str, vocab_size: int, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor on the training device), a collective over the model-parallel ranks.

    Args:
        model: The model chunks (wrapped or not).
        family: Model family for the name mapping (e.g. "qwen3").
        vocab_size: The true vocabulary (padded rows are dropped).
        dtype: Cast to this dtype (None keeps the parameter dtype).

    Yields:
        Contiguous tensors that never alias a parameter (the mapping may return views of one).
    """
    for name, tensor in megatron_state_to_hf(model, family, vocab_size):
        yield name, tensor.detach().to(dtype or tensor.dtype).clone(memory_format=torch.contiguous_format)


def hf_weight_buckets(
    model: list[nn.Module], family: str, vocab_size: int, buffer_size: int, dtype: torch.dtype | None = None
) -> Iterator[Bucket]:
    """`hf_weights` in buckets of at most `buffer_size` bytes (`--update-weight-buffer-size`)."""
    return bucket_named_tensors(hf_weights(model, family, vocab_size, dtype), buffer_size)
