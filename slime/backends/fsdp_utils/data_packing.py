"""Micro-batches for the FSDP trainer: which samples go together, and how they are laid out.

Two layouts, both without per-sample padding; the actor picks one from the model's attention kernel:

* **Shared-prompt rows** (sdpa and eager attention, the default). Samples of a micro-batch that
  have the same prompt (GRPO's n samples per prompt) share one row: `[prompt, response_1,
  response_2, ...]`, with an explicit `[rows, 1, L, L]` mask under which every response sees the
  prompt and its own earlier tokens only, and positions that continue from the prompt in every
  response. Each prompt is computed once instead of n times, and attention stays per group
  rather than over the whole micro-batch. Rows are right-padded to the longest. The first token
  of every response is predicted by the prompt's last position, which the responses share.
* **One packed row** (flash attention). The sequences are concatenated and `position_ids` restart
  at 0 at each sequence start; HF turns the restarts into variable-length attention. Under sdpa
  or eager HF would build a dense `N x N` block-diagonal mask over the whole row instead, which
  on CPU costs 3.4x the time of the shared-prompt layout on a GRPO batch (measured, 32 samples
  of SmolLM2-135M, one thread: 34.1 s vs 9.9 s per forward+backward).

In both, the logit at a row position predicts the token at the next position of the same
sequence; `logit_rows` / `logit_positions` say where each response token's predictor sits.
Measured on CPU: logits equal per-sequence logits within 5e-6 (`tests/integration/test_fsdp_backend.py`
checks 1e-5 for both layouts).

FSDP all-gathers parameters inside every forward, so all data-parallel ranks must run the same
number of forwards: `align_micro_batch_counts` pads short ranks with zero-weight micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from slime.utils.micro_batches import group_samples, plan_step_micro_batches, split_prompt_response, step_slices
from slime.utils.moe_routing import filler_rows, routing_rows

# Attention kernels that take packed sequences through `position_ids` (variable-length attention).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


@dataclass
class PackedMicroBatch:
    """A micro-batch's rows and where its response tokens are.

    Attributes:
        sample_indices: Positions of the samples in this rank's rollout shard, in layout order.
        input_ids: `[R, L]` token ids.
        position_ids: `[R, L]` positions within each sequence.
        attention_mask: `[R, 1, L, L]` mask for shared-prompt rows (bool, or additive float for eager
            attention); None for one packed row, where HF derives the mask from `position_ids`.
        logit_rows: `[M]` the row of each response token's predictor (M = total response length).
        logit_positions: `[M]` the predictor's position in that row.
        target_tokens: `[M]` the response tokens, concatenated in sample order.
        response_lengths: Response length of each sample (splits the `M` axis per sample).
        weight: 1.0, or 0.0 for a padding micro-batch that only keeps collectives aligned.
        sequence_lengths: Tokens of each sequence the forward attends within, padding left out (a sample; or a
            prompt with its responses): what the model FLOPs are counted over.
        routed_experts: `[R, L, num_layers, top_k]` experts to route each position to (MoE routing replay), or None.
    """

    @property
    def head_tokens(self) -> int:
        """Positions that go through the LM head: every row at each column some response token is predicted from."""
        return self.input_ids.shape[0] * int(torch.unique(self.logit_positions).numel())

    sample_indices: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    logit_rows: torch.Tensor
    logit_positions: torch.Tensor
    target_tokens: torch.Tensor
    response_lengths: list[int]
    weight: float = 1.0
    sequence_lengths: list[int] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None


def pack_micro_batch(
    tokens: list[list[int]],
    response_lengths: list[int],
    sample_indices: list[int],
    device: torch.device | str = "cpu",
    weight: float = 1.0,
    routed_experts: list[torch.Tensor] | None = None,
) -> PackedMicroBatch:
    """Concatenate the given samples into one row with restarting positions (variable-length attention).

    Args:
        tokens: Prompt + response token ids of every sample in the shard.
        response_lengths: Response length of every sample in the shard.
        sample_indices: Which samples (shard positions) to pack.
        device: Where the tensors go.
        weight: Loss weight of the micro-batch (0.0 for padding).
        routed_experts: Every sample's engine routing (`Sample.rollout_routed_experts`), to replay; or None.

    Returns:
        The packed micro-batch.
    """
    ids, positions, logit_positions, lengths = [], [], [], []
    for index in sample_indices:
        prompt, response = split_prompt_response(tokens, response_lengths, index)
        start = len(ids) + len(prompt)
        ids.extend(prompt + response)
        positions.extend(range(len(prompt) + len(response)))
        logit_positions.extend(range(start - 1, start + len(response) - 1))
        lengths.append(len(response))
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    logit_positions_tensor = torch.tensor(logit_positions, dtype=torch.long, device=device)
    return PackedMicroBatch(
        sample_indices=list(sample_indices),
        input_ids=input_ids,
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        attention_mask=None,
        logit_rows=torch.zeros_like(logit_positions_tensor),
        logit_positions=logit_positions_tensor,
        target_tokens=input_ids[0, logit_positions_tensor + 1],
        response_lengths=lengths,
        weight=weight,
        sequence_lengths=[len(tokens[index]) for index in sample_indices],
        routed_experts=None
        if routed_experts is None
        else torch.cat([routing_rows(routed_experts[i], len(tokens[i])) for i in sample_indices])[None].to(device),
    )


def pack_shared_prompt_rows(
    tokens: list[list[int]],
    response_lengths: list[int],
    sample_indices: list[int],
    device: torch.device | str = "cpu",
    weight: float = 1.0,
    additive_mask: bool = False,
    routed_experts: list[torch.Tensor] | None = None,
) -> PackedMicroBatch:
    """Lay the given samples out as one row per distinct prompt: the prompt once, then its responses.

    Args:
        tokens: Prompt + response token ids of every sample in the shard.
        response_lengths: Response length of every sample in the shard.
        sample_indices: Which samples (shard positions) to lay out.
        device: Where the tensors go.
        weight: Loss weight of the micro-batch (0.0 for padding).
        additive_mask: Give the mask as 0 / -inf floats (eager attention) instead of booleans (sdpa).
        routed_experts: Every sample's engine routing (`Sample.rollout_routed_experts`), to replay; or None. A
            shared prompt takes the routing of its first sample.

    Returns:
        The micro-batch; its `sample_indices` are grouped by prompt, in order of first appearance.
    """
    rows: dict[tuple[int, ...], list[int]] = {}
    for index in sample_indices:
        prompt, _ = split_prompt_response(tokens, response_lengths, index)
        rows.setdefault(tuple(prompt), []).append(index)
    width = max(len(prompt) + sum(response_lengths[i] for i in members) for prompt, members in rows.items())

    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    # segment 0 is the prompt, segment k the k-th response; -1 marks padding
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    routing = None
    if routed_experts is not None:
        _, num_layers, top_k = routed_experts[sample_indices[0]].shape
        routing = filler_rows(len(rows) * width, num_layers, top_k).view(len(rows), width, num_layers, top_k)
    ordered, targets, logit_rows, logit_positions, lengths = [], [], [], [], []
    for row, (prompt, members) in enumerate(rows.items()):
        ids, positions, segment = list(prompt), list(range(len(prompt))), [0] * len(prompt)
        for k, index in enumerate(members, start=1):
            response = tokens[index][len(prompt) :]
            start = len(ids)
            if routing is not None:
                own = routing_rows(routed_experts[index], len(tokens[index]))
                if k == 1:  # the shared prompt takes its first sample's routing
                    routing[row, : len(prompt)] = own[: len(prompt)]
                routing[row, start : start + len(response)] = own[len(prompt) :]
            ids += response
            positions += range(len(prompt), len(prompt) + len(response))
            segment += [k] * len(response)
            # the prompt's last position predicts the first response token, then the response itself
            logit_positions += [len(prompt) - 1, *range(start, start + len(response) - 1)]
            logit_rows += [row] * len(response)
            lengths.append(len(response))
            targets += response
            ordered.append(index)
        input_ids[row, : len(ids)] = torch.tensor(ids)
        position_ids[row, : len(ids)] = torch.tensor(positions)
        segments[row, : len(ids)] = torch.tensor(segment)

    query, key = segments[:, :, None], segments[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (query >= 0) & ((key == 0) | (key == query))
    allowed |= torch.eye(width, dtype=torch.bool)  # padding positions see themselves: no all-masked softmax rows
    mask = allowed[:, None]
    if additive_mask:
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)

    return PackedMicroBatch(
        sample_indices=ordered,
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=mask.to(device),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        logit_positions=torch.tensor(logit_positions, dtype=torch.long, device=device),
        target_tokens=torch.tensor(targets, dtype=torch.long, device=device),
        response_lengths=lengths,
        weight=weight,
        sequence_lengths=[len(prompt) + sum(response_lengths[i] for i in members) for prompt, members in rows.items()],
        routed_experts=None if routing is None else routing.to(device),
    )


def plan_shared_prompt_micro_batches(
    tokens: list[list[int]], response_lengths: list[int], num_steps: int, max_tokens: int
) -> list[list[list[int]]]:
    """The micro-batches of every step for shared-prompt rows under a token budget (dynamic batch size).

    Samples with the same prompt are kept together and cost their prompt once: units of one prompt
    plus as many of its responses as fit in `max_tokens`, packed first-fit decreasing.

    Returns:
        For each step, lists of shard positions, one per micro-batch.
    """
    plan = []
    for block in step_slices(len(tokens), num_steps):
        units: list[list[int]] = []
        costs: list[int] = []
        open_unit: dict[tuple[int, ...], int] = {}  # prompt -> index of its unit that still takes samples
        for index in block:
            prompt, response = split_prompt_response(tokens, response_lengths, index)
            unit = open_unit.get(tuple(prompt))
            if unit is None or costs[unit] + len(response) > max_tokens:
                unit = len(units)
                units.append([])
                costs.append(len(prompt))
                open_unit[tuple(prompt)] = unit
            units[unit].append(index)
            costs[unit] += len(response)
        bins = group_samples(list(range(len(units))), costs, max_tokens=max_tokens)
        plan.append([sorted(index for unit in bin_ for index in units[unit]) for bin_ in bins])
    return plan


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
    attn_implementation: str = "sdpa",
    routed_experts: list[torch.Tensor] | None = None,
) -> list[list[PackedMicroBatch]]:
    """Micro-batches of every optimizer step of this rank's shard, aligned across ranks.

    Args:
        tokens: Prompt + response token ids of each sample of the shard.
        response_lengths: Response length of each sample.
        num_steps: Optimizer steps in the rollout.
        micro_batch_size: Samples per micro-batch when `max_tokens` is None.
        max_tokens: Token budget per micro-batch (dynamic batch size), or None.
        device: Where the tensors go.
        process_group: The data-parallel group used to align micro-batch counts.
        attn_implementation: The model's `config._attn_implementation`; picks the layout (module docstring).
        routed_experts: Each sample's engine routing, laid out with the tokens for routing replay; or None.

    Returns:
        For each step, its micro-batches; padding ones (weight 0) repeat the step's first micro-batch.
    """
    shared = attn_implementation not in VARLEN_ATTENTION
    additive = attn_implementation == "eager"

    def layout(group: list[int], weight: float = 1.0) -> PackedMicroBatch:
        if not shared:
            return pack_micro_batch(tokens, response_lengths, group, device, weight, routed_experts)
        return pack_shared_prompt_rows(
            tokens, response_lengths, group, device, weight, additive_mask=additive, routed_experts=routed_experts
        )

    if shared and max_tokens is not None:
        plan = plan_shared_prompt_micro_batches(tokens, response_lengths, num_steps, max_tokens)
    else:
        plan = plan_step_micro_batches(tokens, num_steps, micro_batch_size, max_tokens)
    steps = []
    for groups in plan:
        target = align_micro_batch_counts(groups, process_group)
        micro_batches = [layout(group) for group in groups]
        micro_batches += [layout(groups[0], weight=0.0) for _ in range(target - len(groups))]
        steps.append(micro_batches)
    return steps


def _collective_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """CPU for gloo, the current CUDA device for NCCL."""
    backend = dist.get_backend(process_group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
