"""Zig-zag context-parallel slicing of packed rows, and gathering per-token results back.

With context parallelism (CP = c ranks) every sequence of a packed row is cut into 2c equal chunks
and rank r keeps chunks r and 2c-1-r: causal attention costs grow along a sequence, so pairing an
early chunk with a late one balances the work. Sequences are padded to a multiple of 2c first
(`data.pack_micro_batch(..., sequence_pad_multiple=2c)`). TransformerEngine's attention receives
the local tokens plus the full `cu_seqlens` and runs ring attention over the CP group.

Per-token results (log-probs, entropies) are computed on each rank's own positions and all-gathered
into row order with `gather_zigzag`, whose backward keeps the local part of the gradient: every CP
rank then computes the same loss from the full row, and Megatron's schedule scales the loss by the
CP size so that DDP's average over data x context ranks sums each token's gradient once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def zigzag_positions(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Row positions a CP rank keeps: chunks `cp_rank` and `2*cp_size-1-cp_rank` of every sequence.

    Args:
        cu_seqlens: Sequence boundaries in the row; each length must be a multiple of `2 * cp_size`.
        cp_size: Context-parallel size.
        cp_rank: This rank in the CP group.

    Returns:
        `[N / cp_size]` int64 positions in increasing order within each sequence.
    """
    pieces = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"a packed sequence of {length} tokens cannot be split into {2 * cp_size} chunks for "
                f"--context-parallel-size {cp_size}; pack with sequence_pad_multiple={2 * cp_size}"
            )
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def zigzag_slice(row: torch.Tensor, cu_seqlens: list[int], cp_size: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """This CP rank's part of a packed row tensor (e.g. `[1, N]` input ids) along `dim`."""
    index = zigzag_positions(cu_seqlens, cp_size, cp_rank).to(row.device)
    return row.index_select(dim, index)


class _GatherZigzag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, cu_seqlens, cp_size, cp_rank, group):
        ctx.positions = zigzag_positions(cu_seqlens, cp_size, cp_rank).to(local.device)
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = local.new_empty((cu_seqlens[-1],) + tuple(local.shape[1:]))
        for rank, part in enumerate(parts):
            full[zigzag_positions(cu_seqlens, cp_size, rank).to(local.device)] = part
        return full

    @staticmethod
    def backward(ctx, grad_full):
        return grad_full[ctx.positions], None, None, None, None


def gather_zigzag(
    local: torch.Tensor, cu_seqlens: list[int], cp_size: int, cp_rank: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """All-gather per-position values (`[N / cp, ...]` on each rank) into row order (`[N, ...]`).

    Backward passes each rank the gradient of its own positions only.
    """
    if cp_size == 1:
        return local
    return _GatherZigzag.apply(local, list(cu_seqlens), cp_size, cp_rank, group)
