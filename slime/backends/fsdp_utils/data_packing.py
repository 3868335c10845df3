"""Micro-batches for the FSDP trainer: which samples go together, and how they are packed into one row.

A micro-batch is packed WITHOUT padding: its sequences are concatenated into a single row of
token ids, and `position_ids` restart at 0 at each sequence start. HuggingFace's mask builder
(sdpa and eager attention, transformers >= 4.5x) reads the restarts from `position_ids` when no
attention mask is given and builds a block-diagonal causal mask, so every sequence only sees
itself. Measured on CPU with sdpa: packed logits equal per-sequence logits within 5e-6
(`tests/test_fsdp_backend.py` checks 1e-5).

Within the row, the logit at position `p` predicts token `p + 1`. For a sample with `T` tokens
of which the last `R` are the response, starting at offset `o`, the response tokens are
`row[o + T - R : o + T]` and their logits sit at `o + T - R - 1 ... o + T - 2`.

FSDP all-gathers parameters inside every forward, so all data-parallel ranks must run the same
number of forwards: `align_micro_batch_counts` pads short ranks with zero-weight micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime.utils.micro_batches import plan_step_micro_batches


@dataclass
class PackedMicroBatch:
    """One packed row and where its response tokens are.

    Attributes:
        sample_indices: Positions of the samples in this rank's rollout shard, in packing order.
        input_ids: `[1, N]` concatenated token ids.
        position_ids: `[1, N]` positions, restarting at 0 for each sample.
        logit_positions: `[M]` row positions whose logits predict the response tokens (M = total response length).
        target_tokens: `[M]` the response tokens, concatenated in sample order.
        response_lengths: Response length of each sample (splits the `M` axis per sample).
        weight: 1.0, or 0.0 for a padding micro-batch that only keeps collectives aligned.
    """

    sample_indices: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logit_positions: torch.Tensor
    target_tokens: torch.Tensor
    response_lengths: list[int]
    weight: float = 1.0


def pack_micro_batch(
    tokens: list[list[int]],
    response_lengths: list[int],
    sample_indices: list[int],
    device: torch.device | str = "cpu",
    weight: float = 1.0,
) -> PackedMicroBatch:
    """Concatenate the given samples into one row with restarting positions.

    Args:
        tokens: Prompt + response token ids of every sample in the shard.
        response_lengths: Response length of every sample in the shard.
        sample_indices: Which samples (shard positions) to pack.
        device: Where the tensors go.
        weight: Loss weight of the micro-batch (0.0 for padding).

    Returns:
        The packed micro-batch.
    """
    ids, positions, logit_positions, lengths = [], [], [], []
    offset = 0
    for index in sample_indices:
        sample = tokens[index]
        total, response = len(sample), response_lengths[index]
        if not 0 < response < total:
            raise ValueError(
                f"sample {index} has {total} tokens and response_length {response}; a trainable sample needs "
                "at least one prompt token and one response token"
            )
        ids.extend(sample)
        positions.extend(range(total))
        logit_positions.extend(range(offset + total - response - 1, offset + total - 1))
        lengths.append(response)
        offset += total
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    logit_positions_tensor = torch.tensor(logit_positions, dtype=torch.long, device=device)
    return PackedMicroBatch(
        sample_indices=list(sample_indices),
        input_ids=input_ids,
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        logit_positions=logit_positions_tensor,
        target_tokens=input_ids[0, logit_positions_tensor + 1],
        response_lengths=lengths,
        weight=weight,
    )


def align_micro_batch_counts(groups: list[list[int]], process_group: dist.ProcessGroup | None = None) -> int:
    """How many micro-batches every rank must run: the largest count over the data-parallel ranks.

    Args:
        groups: This rank's micro-batches of one step.
        process_group: The data-parallel group (default group when None).

    Returns:
        The common micro-batch count; ranks with fewer add zero-weight copies of a micro-batch.
    """
    count = torch.tensor([len(groups)], dtype=torch.long)
    if dist.is_available() and dist.is_initialized():
        count = count.to(_collective_device(process_group))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=process_group)
    return int(count.item())


def build_step_micro_batches(
    tokens: list[list[int]],
    response_lengths: list[int],
    num_steps: int,
    micro_batch_size: int | None,
    max_tokens: int | None,
    device: torch.device | str = "cpu",
    process_group: dist.ProcessGroup | None = None,
) -> list[list[PackedMicroBatch]]:
    """Packed micro-batches of every optimizer step of this rank's shard, aligned across ranks.

    Args:
        tokens: Prompt + response token ids of each sample of the shard.
        response_lengths: Response length of each sample.
        num_steps: Optimizer steps in the rollout.
        micro_batch_size: Samples per micro-batch when `max_tokens` is None.
        max_tokens: Token budget per micro-batch (dynamic batch size), or None.
        device: Where the tensors go.
        process_group: The data-parallel group used to align micro-batch counts.

    Returns:
        For each step, its micro-batches; padding ones (weight 0) repeat the step's first micro-batch.
    """
    steps = []
    for groups in plan_step_micro_batches(tokens, num_steps, micro_batch_size, max_tokens):
        target = align_micro_batch_counts(groups, process_group)
        micro_batches = [pack_micro_batch(tokens, response_lengths, group, device) for group in groups]
        micro_batches += [
            pack_micro_batch(tokens, response_lengths, groups[0], device, weight=0.0)
            for _ in range(target - len(groups))
        ]
        steps.append(micro_batches)
    return steps


def _collective_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """CPU for gloo, the current CUDA device for NCCL."""
    backend = dist.get_backend(process_group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
