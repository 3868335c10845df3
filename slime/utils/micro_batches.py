"""Which samples of a rank's rollout shard form each optimizer step and each micro-batch.

Backend-neutral planning shared by the FSDP and Megatron trainers; how a micro-batch is laid out
as tensors (packed row, padding, attention metadata) stays in each backend.
"""

from __future__ import annotations

import torch


def step_slices(num_samples: int, num_steps: int) -> list[range]:
    """The samples of each optimizer step: `num_steps` equal consecutive blocks of the shard.

    Args:
        num_samples: Samples in this rank's shard.
        num_steps: Optimizer steps in the rollout (`num_steps` of the shard).

    Returns:
        One `range` of shard positions per step.

    Raises:
        ValueError: when the shard does not split evenly, naming the batch-size flags to fix.
    """
    if num_steps < 1 or num_samples % num_steps:
        raise ValueError(
            f"{num_samples} samples on this rank do not split into {num_steps} equal optimizer steps; the rollout "
            "data must hold --global-batch-size x --num-steps-per-rollout samples split evenly over data-parallel ranks"
        )
    size = num_samples // num_steps
    return [range(step * size, (step + 1) * size) for step in range(num_steps)]


def group_samples(
    sample_indices: list[int],
    lengths: list[int],
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """Split one step's samples into micro-batches.

    With `max_tokens` (dynamic batch size), first-fit decreasing: samples, longest first, go into
    the first micro-batch with room, so each micro-batch holds at most `max_tokens` tokens (a
    sample longer than that gets a micro-batch of its own). Otherwise consecutive chunks of
    `micro_batch_size` samples.

    Args:
        sample_indices: Shard positions of the step's samples.
        lengths: Total token count (prompt + response) of each of those samples.
        micro_batch_size: Samples per micro-batch (`--micro-batch-size`), used without `max_tokens`.
        max_tokens: Token budget per micro-batch (`--max-tokens-per-gpu` with `--use-dynamic-batch-size`).

    Returns:
        Lists of shard positions, one per micro-batch; each list keeps the original sample order.
    """
    if max_tokens is None:
        if not micro_batch_size or micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
        return [sample_indices[i : i + micro_batch_size] for i in range(0, len(sample_indices), micro_batch_size)]
    if max_tokens < 1:
        raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for position in sorted(range(len(sample_indices)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[position] <= max_tokens:
                bins[b].append(position)
                loads[b] += lengths[position]
                break
        else:
            bins.append([position])
            loads.append(lengths[position])
    return [[sample_indices[p] for p in sorted(b)] for b in bins]


def plan_step_micro_batches(
    tokens: list[list[int]], num_steps: int, micro_batch_size: int | None, max_tokens: int | None
) -> list[list[list[int]]]:
    """The micro-batches of every optimizer step of a shard, as lists of shard positions.

    Args:
        tokens: Prompt + response token ids of each sample of the shard.
        num_steps: Optimizer steps in the rollout.
        micro_batch_size: Samples per micro-batch when `max_tokens` is None.
        max_tokens: Token budget per micro-batch (dynamic batch size), or None.

    Returns:
        For each step, its micro-batches (see `group_samples`).
    """
    plan = []
    for block in step_slices(len(tokens), num_steps):
        indices = list(block)
        plan.append(group_samples(indices, [len(tokens[i]) for i in indices], micro_batch_size, max_tokens))
    return plan


def split_prompt_response(
    tokens: list[list[int]], response_lengths: list[int], index: int
) -> tuple[list[int], list[int]]:
    """(prompt, response) token ids of shard sample `index`, refusing a sample that cannot be trained on.

    Raises:
        ValueError: naming the sample when it lacks a prompt token or a response token.
    """
    sample, response = tokens[index], response_lengths[index]
    if not 0 < response < len(sample):
        raise ValueError(
            f"sample {index} has {len(sample)} tokens and response_length {response}; a trainable sample needs "
            "at least one prompt token and one response token"
        )
    return sample[: len(sample) - response], sample[len(sample) - response :]


def split_per_sample(values: torch.Tensor, response_lengths: list[int]) -> list[torch.Tensor]:
    """Split a flat `[M]` tensor over a micro-batch's response tokens into one tensor per sample."""
    return list(torch.split(values, response_lengths))
