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

Upstream slime's per-sample helpers are here too, for user code written against them (`slice_log_prob_with_cp`,
`all_gather_with_cp`): they work on one sample's response, of which a CP rank holds the log-probs at the positions
it keeps. The log-prob of response token i comes from the logits at position `prompt_length - 1 + i`, so a
rank's share is response entries `p - (prompt_length - 1)` for its positions p in `[prompt_length - 1,
total_length - 1)`, in order. The sample counts as padded to a multiple of 2c, as packing pads it. slime's own
trainer gathers every row before the loss, so the TIS and loss functions it calls get whole responses on every
CP rank, never a share.
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


def _context_parallel() -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, rank, size) of megatron-core's context-parallel group; (None, 0, 1) in a process without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() == 1:
        return None, 0, 1
    group = parallel_state.get_context_parallel_group()
    return group, parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()


def _response_share(
    total_length: int, response_length: int, cp_size: int, cp_rank: int, padded_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a CP rank's share of a sample's response sits: (indices into the response, indices into the rank's
    local positions of the padded sample), both in order (module doc)."""
    prompt_length = total_length - response_length
    if response_length < 0 or prompt_length < 1:
        raise ValueError(
            f"a sample of {total_length} tokens with a {response_length}-token response: the prompt needs at least "
            "one token (the first response token's log-prob comes from the last prompt token's logits)"
        )
    positions = zigzag_positions([0, padded_length], cp_size, cp_rank)
    in_response = (positions >= prompt_length - 1) & (positions < total_length - 1)
    return positions[in_response] - (prompt_length - 1), in_response.nonzero().squeeze(-1)


def _padded_length(length: int, cp_size: int) -> int:
    return -(-length // (2 * cp_size)) * 2 * cp_size


def slice_log_prob_with_cp(
    log_prob: list[float] | torch.Tensor,
    total_length: int,
    response_length: int,
    qkv_format: str = "thd",
    max_token_len: int | None = None,
) -> list[float] | torch.Tensor:
    """Upstream's per-sample CP slicer: this CP rank's share of one sample's per-response-token values.

    Args:
        log_prob: `response_length` values (a list or a tensor whose first dimension is the response).
        total_length: Prompt plus response tokens of the sample.
        response_length: Response tokens of the sample.
        qkv_format: "thd" (packed: the sample is padded to a multiple of 2 x CP) or "bshd" (padded to
            `max_token_len`, rounded up to a multiple of 2 x CP).
        max_token_len: The padded row length for "bshd".

    Returns:
        The same type as `log_prob`: the values at this rank's positions, in order; `log_prob` itself without CP.
    """
    if len(log_prob) != response_length:
        raise ValueError(f"{len(log_prob)} values for a response of {response_length} tokens; they must match")
    _, rank, size = _context_parallel()
    if size == 1:
        return log_prob
    if qkv_format == "bshd" and max_token_len is None:
        raise ValueError("qkv_format='bshd' pads every sample to max_token_len; pass it")
    padded = _padded_length(max_token_len if qkv_format == "bshd" else total_length, size)
    response_index, _ = _response_share(total_length, response_length, size, rank, padded)
    if isinstance(log_prob, torch.Tensor):
        return log_prob[response_index.to(log_prob.device)]
    return [log_prob[i] for i in response_index.tolist()]


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """Upstream's per-sample CP gather: the whole response from each CP rank's share (`slice_log_prob_with_cp`).

    Every rank gets the same `[response_length, ...]` tensor. As with `gather_zigzag`, the backward passes each
    rank the gradient of its own share only. Without CP, `tensor` is returned as is.

    Args:
        tensor: This rank's share, `[share, ...]`, of a sample packed as "thd" (padded to a multiple of 2 x CP).
        total_length: Prompt plus response tokens of the sample.
        response_length: Response tokens of the sample.
    """
    group, rank, size = _context_parallel()
    if size == 1:
        return tensor
    padded = _padded_length(total_length, size)
    _, local_index = _response_share(total_length, response_length, size, rank, padded)
    if tensor.shape[0] != len(local_index):
        raise ValueError(
            f"CP rank {rank} holds {len(local_index)} of the {response_length} response positions of this sample, "
            f"but got a tensor of {tensor.shape[0]}; pass this rank's share (slice_log_prob_with_cp), not the "
            "whole response"
        )
    # This rank's share placed at its positions of the padded sample, zeros elsewhere, gathered into row order.
    local = tensor.new_zeros((padded // size, *tensor.shape[1:])).index_copy(0, local_index.to(tensor.device), tensor)
    full = gather_zigzag(local, [0, padded], size, rank, group)
    prompt_length = total_length - response_length
    return full[prompt_length - 1 : total_length - 1]
