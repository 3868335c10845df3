"""Multi-token prediction (MTP) training: `--enable-mtp-training --mtp-num-layers D` on the Megatron backend.

megatron-core's GPTModel runs its MTP block only when it is given labels, and then returns the language-model loss
instead of the logits. The RL losses need the logits, so the forward here passes the labels and keeps what the
output layer computes: its first D calls are the MTP depths' logits, its last one the main logits. The MTP losses
reach the gradients through megatron-core's `MTPLossAutoScaler`, scaled by `--mtp-loss-scaling-factor / D`; the
schedule divides them by the number of micro-batches, as it divides the main loss.

Depth k (1-based) predicts, from position p, the token at p + k + 1. It trains where that token is a response
token with loss mask 1 and p lies in the same sample.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from slime.backends.megatron_utils.loss import log_probs_and_entropy


def mtp_loss_mask(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    logit_positions: torch.Tensor,
    response_mask: torch.Tensor,
    depth: int,
) -> torch.Tensor:
    """`[1, N]` float mask in megatron-core's convention (position q weighs the label of q, rolled once per depth).

    Position q is 1 when its logits predict a trained response token (`logit_positions` with `response_mask` 1) and
    q - `depth` lies in the same sequence, so that every depth's rolled position stays inside one sample.

    Args:
        input_ids: `[1, N]` the packed row.
        cu_seqlens: `[S + 1]` sequence boundaries in the row.
        logit_positions: `[M]` row positions predicting the response tokens.
        response_mask: `[M]` the loss mask of those tokens.
        depth: `--mtp-num-layers`.
    """
    length = input_ids.shape[1]
    trained = torch.zeros(length, dtype=torch.bool, device=input_ids.device)
    trained[logit_positions] = response_mask.to(device=input_ids.device).bool()
    positions = torch.arange(length, device=input_ids.device)
    boundaries = cu_seqlens.to(input_ids.device).long()[1:]
    sequence = torch.bucketize(positions, boundaries, right=True)
    earlier = (positions - depth).clamp(min=0)
    same_sequence = (positions >= depth) & (sequence[earlier] == sequence)
    return (trained & same_sequence).float()[None]


@contextlib.contextmanager
def output_layer_calls(gpt_model: torch.nn.Module, vocab_size: int) -> Iterator[list[torch.Tensor]]:
    """The logits of every call of `gpt_model.output_layer` inside the block, in call order (`[s, b, v/TP]`).

    The model goes on with a copy whose padded vocabulary entries are -inf: megatron-core's cross-entropy works in
    place on the logits it is given, and over the padded vocabulary, whose zero logits would take probability mass
    (and train the padding rows) where the true model has no token.
    """
    from megatron.core import parallel_state

    calls: list[torch.Tensor] = []

    def keep(module, inputs, output):
        logits, bias = output
        calls.append(logits)
        width = logits.shape[-1]
        first = parallel_state.get_tensor_model_parallel_rank() * width
        padded = torch.arange(first, first + width, device=logits.device) >= vocab_size
        return logits.masked_fill(padded, float("-inf")), bias

    handle = gpt_model.output_layer.register_forward_hook(keep)
    try:
        yield calls
    finally:
        handle.remove()


def forward_with_mtp(
    chunk: torch.nn.Module,
    gpt_model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    loss_mask: torch.Tensor,
    vocab_size: int,
    **kwargs,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run `chunk` (the wrapped `gpt_model`) with next-token labels so its MTP block runs and adds its losses.

    Args:
        loss_mask: `mtp_loss_mask`'s.
        vocab_size: The true vocabulary (the MTP losses leave the padding out).

    Returns:
        (`[1, N, v/TP]` main logits, the D MTP depths' `[1, N, v/TP]` logits).
    """
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    with output_layer_calls(gpt_model, vocab_size) as calls:
        chunk(input_ids, position_ids, attention_mask, labels=labels, loss_mask=loss_mask, **kwargs)
    *depths, main = (logits.transpose(0, 1) for logits in calls)
    return main, depths


def mtp_cross_entropy(
    depth_logits: list[torch.Tensor], input_ids: torch.Tensor, loss_mask: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Mean over the depths of each depth's masked mean cross-entropy: the value `--mtp-loss-scaling-factor` weighs,
    for logging (megatron-core's own copy carries the gradient).

    Labels and mask are rolled once more per depth, as megatron-core rolls them; the logits are this rank's
    vocabulary slice (`[1, N, v/TP]`).
    """
    labels, mask, losses = input_ids[0], loss_mask[0], []
    for logits in depth_logits:
        labels, mask = torch.roll(labels, -1), torch.roll(mask, -1)
        positions = mask.nonzero().squeeze(-1)
        targets = torch.roll(labels, -1)[positions]
        log_probs, _ = log_probs_and_entropy(logits[0, positions], targets, vocab_size, with_entropy=False)
        losses.append(-log_probs.mean() if positions.numel() else log_probs.new_zeros(()))
    return torch.stack(losses).mean()
