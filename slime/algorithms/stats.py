"""Masked mean and whitening, optionally over the ranks of a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (over `dim`, or everything); 0 where the mask is empty.

    Args:
        values (`torch.Tensor`):
            Values to average.
        mask (`torch.Tensor`):
            0/1 mask broadcastable to `values`.
        dim (`int`, *optional*):
            Dimension to reduce; all dimensions when `None`.

    Returns:
        `torch.Tensor`: The masked mean.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1e-8)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten `values` with the mean and (population, i.e. biased) variance of the masked entries.

    Args:
        values (`torch.Tensor`):
            Values to whiten (typically all advantages of a batch, concatenated).
        mask (`torch.Tensor`):
            0/1 mask, same shape.
        shift_mean (`bool`, *optional*, defaults to `True`):
            If `False`, the mean is added back, so only the scale changes.

    Returns:
        `torch.Tensor`: `(values - mean) / sqrt(var + 1e-8)` (plus `mean` if not `shift_mean`), computed
        on every entry; masked-out entries are transformed too but did not enter the statistics.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean).pow(2), mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def distributed_masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`masked_whiten` with the statistics summed over all ranks of `process_group` (e.g. DP x CP).

    Falls back to `masked_whiten` when torch.distributed is not initialized. Every rank must call it.

    Args:
        values (`torch.Tensor`):
            This rank's values.
        mask (`torch.Tensor`):
            This rank's 0/1 mask, same shape.
        shift_mean (`bool`, *optional*, defaults to `True`):
            If `False`, the global mean is added back.
        process_group (`dist.ProcessGroup`, *optional*):
            Group to reduce over; the default group when `None`.

    Returns:
        `torch.Tensor`: This rank's whitened values, using global mean and variance.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return masked_whiten(values, mask, shift_mean)
    mask = mask.to(values.dtype)
    totals = torch.stack([(values * mask).sum(), mask.sum()])
    dist.all_reduce(totals, group=process_group)
    count = totals[1].clamp_min(1e-8)
    mean = totals[0] / count
    squared_error = ((values - mean).pow(2) * mask).sum()
    dist.all_reduce(squared_error, group=process_group)
    whitened = (values - mean) * torch.rsqrt(squared_error / count + 1e-8)
    return whitened if shift_mean else whitened + mean
