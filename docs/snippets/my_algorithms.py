"""New algorithms for `--custom-algorithm-module my_algorithms`: one decorated function each."""

from __future__ import annotations

import torch

from slime.algorithms import (
    register_advantage_estimator,
    register_kl_estimator,
    register_loss_aggregation,
    register_policy_loss,
)
from slime.algorithms.advantages import grpo_group_rewards


@register_advantage_estimator("clipped_grpo", group_rewards=grpo_group_rewards)
def clipped_grpo(args, data):
    """GRPO's group-normalized reward on every response token, clipped to [-2, 2]."""
    advantages = [torch.full(m.shape, float(r)).clamp(-2.0, 2.0) for r, m in zip(data["rewards"], data["loss_masks"])]
    return advantages, advantages


@register_policy_loss("capped_ratio_pg")
def capped_ratio_pg(args, log_probs, old_log_probs, advantages, loss_masks):
    """Policy gradient with the ratio pi / pi_old capped at 1 + --eps-clip (no lower bound)."""
    ratio = torch.exp(log_probs - old_log_probs).clamp(max=1.0 + args.eps_clip)
    return -advantages * ratio, {"ratio": ratio.detach()}


@register_kl_estimator("k2_clamped", clamp=5.0)
def k2_clamped(log_ratio):
    """Half the squared log-ratio; slime clamps the estimate to [-5, 5]."""
    return 0.5 * log_ratio.square()


@register_loss_aggregation("seq-mean-token-sqrt")
def seq_mean_token_sqrt(values, masks, counts):
    """Each sample's masked token sum over the square root of its token count, averaged over the step's samples."""
    total = sum((v * m).sum() / m.sum().clamp(min=1).sqrt() for v, m in zip(values, masks))
    return total / counts.num_samples
