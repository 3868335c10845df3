"""Micro-batches for the Megatron trainer: which samples go together and how they become one packed row.

A micro-batch concatenates its sequences into a single row `[1, N]` (THD layout, no padding between
sequences); `cu_seqlens` marks where each sequence starts. Two attention paths read it:

- TransformerEngine (GPU): `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)`,
  so attention and RoPE restart at every sequence.
- megatron-core's local spec (CPU): its attention refuses `PackedSeqParams`, so the row gets a
  block-diagonal causal mask instead (`True` = masked). RoPE then sees row positions, not
  per-sequence ones, which changes nothing: with the mask a token only attends inside its own
  sequence, and rotary attention scores depend only on the distance between two positions.

The row is padded at its end to a multiple of `pad_multiple` (the tensor-parallel size, times
2 x context-parallel size with CP) by one extra padding sequence that no response token reads.

Within the row the logit at position `p` predicts token `p + 1`: a sample with `T` tokens whose
last `R` are the response, starting at offset `o`, has its response logits at `o+T-R-1 ... o+T-2`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.utils.micro_batches import plan_step_micro_batches, split_prompt_response
from slime.utils.moe_routing import filler_rows, routing_rows


@dataclass
class PackedMicroBatch:
    """One packed row and where its response tokens are.

    Attributes:
        sample_indices: Shard positions of the samples, in packing order.
        input_ids: `[1, N]` token ids (N includes the end padding).
        position_ids: `[1, N]` positions restarting at 0 for each sequence.
        cu_seqlens: `[S + 1]` int32 sequence boundaries in the row (the padding is the last sequence).
        max_seqlen: Longest sequence in the row.
        logit_positions: `[M]` row positions whose logits predict the response tokens.
        target_tokens: `[M]` the response tokens in sample order.
        response_lengths: Response length of each sample (splits the `M` axis).
        routed_experts: `[1, N, num_layers, top_k]` experts to route each position to (MoE routing replay), or None.
        response_loss_mask: `[M]` loss mask of the response tokens, set for a training step with MTP (mtp.py).
        mtp_loss: The MTP cross-entropy the training forward computed (mtp.py), None without MTP.
    """

    sample_indices: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    logit_positions: torch.Tensor
    target_tokens: torch.Tensor
    response_lengths: list[int]
    routed_experts: torch.Tensor | None = None
    response_loss_mask: torch.Tensor | None = None
    mtp_loss: float | None = None

    def attention_mask(self) -> torch.Tensor:
        """`[1, 1, N, N]` bool mask for the local attention: True where a query may NOT look."""
        length = self.input_ids.shape[1]
        boundaries = self.cu_seqlens.to(self.input_ids.device).long()
        sequence_of = torch.bucketize(torch.arange(length, device=boundaries.device), boundaries[1:], right=True)
        same_sequence = sequence_of[:, None] == sequence_of[None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=boundaries.device).tril()
        return ~(same_sequence & causal)[None, None]

    def packed_seq_params(self):
        """Megatron's `PackedSeqParams` (THD) for TransformerEngine attention."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def pack_micro_batch(
    tokens: list[list[int]],
    response_lengths: list[int],
    sample_indices: list[int],
    pad_multiple: int = 1,
    pad_token_id: int = 0,
    device: torch.device | str = "cpu",
    sequence_pad_multiple: int = 1,
    routed_experts: list[torch.Tensor] | None = None,
) -> PackedMicroBatch:
    """Concatenate samples into one row; pad the row's end to a multiple of `pad_multiple`.

    Args:
        tokens: Prompt + response ids of every sample in the shard.
        response_lengths: Response length of every sample in the shard.
        sample_indices: Which samples to pack.
        pad_multiple: Row length multiple (TP size, x 2 CP size with context parallelism).
        pad_token_id: Id used for the padding tokens (never a target).
        device: Where the tensors go.
        sequence_pad_multiple: Pad every sequence at its end to this multiple (2 x CP size for
            context parallelism; causal attention keeps the padding invisible to the real tokens).
        routed_experts: Every sample's engine routing (`Sample.rollout_routed_experts`), to replay; or None.
    """
    ids: list[int] = []
    routing: list[torch.Tensor] = []
    positions: list[int] = []
    logit_positions: list[int] = []
    boundaries = [0]
    lengths = []
    for index in sample_indices:
        prompt, response_tokens = split_prompt_response(tokens, response_lengths, index)
        total, response = len(prompt) + len(response_tokens), len(response_tokens)
        offset = len(ids)
        ids.extend(prompt + response_tokens)
        positions.extend(range(total))
        logit_positions.extend(range(offset + total - response - 1, offset + total - 1))
        sequence_padding = -total % sequence_pad_multiple
        if routed_experts is not None:
            routing.append(routing_rows(routed_experts[index], total + sequence_padding))
        ids.extend([pad_token_id] * sequence_padding)
        positions.extend(range(total, total + sequence_padding))
        boundaries.append(len(ids))
        lengths.append(response)
    padding = -len(ids) % pad_multiple
    if padding:
        # Its own sequence; with context parallelism it must split into chunks like the others.
        padding += -padding % sequence_pad_multiple
        ids.extend([pad_token_id] * padding)
        positions.extend(range(padding))
        boundaries.append(len(ids))
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    logit_index = torch.tensor(logit_positions, dtype=torch.long, device=device)
    if routing:
        _, num_layers, top_k = routing[0].shape
        routing.append(filler_rows(len(ids) - boundaries[len(routing)], num_layers, top_k))  # the row's end padding
    return PackedMicroBatch(
        sample_indices=list(sample_indices),
        input_ids=input_ids,
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        cu_seqlens=torch.tensor(boundaries, dtype=torch.int32, device=device),
        max_seqlen=max(b - a for a, b in zip(boundaries[:-1], boundaries[1:], strict=True)),
        logit_positions=logit_index,
        target_tokens=input_ids[0, logit_index + 1],
        response_lengths=lengths,
        routed_experts=torch.cat(routing)[None].to(device) if routing else None,
    )


def build_step_micro_batches(
    tokens: list[list[int]],
    response_lengths: list[int],
    num_steps: int,
    micro_batch_size: int | None,
    max_tokens: int | None,
    pad_multiple: int = 1,
    device: torch.device | str = "cpu",
    sequence_pad_multiple: int = 1,
    routed_experts: list[torch.Tensor] | None = None,
) -> list[list[PackedMicroBatch]]:
    """Packed micro-batches of every optimizer step of this data-parallel shard (`routed_experts`: every
    sample's engine routing, laid out with the tokens for routing replay; or None).

    Data-parallel ranks may run different numbers of micro-batches: Megatron's DDP reduces
    gradients once per step (`finalize_model_grads`), not per forward.

    Returns:
        For each step, its micro-batches.
    """
    steps = []
    for groups in plan_step_micro_batches(tokens, num_steps, micro_batch_size, max_tokens):
        steps.append(
            [
                pack_micro_batch(
                    tokens, response_lengths, g, pad_multiple, 0, device, sequence_pad_multiple, routed_experts
                )
                for g in groups
            ]
        )
    return steps
