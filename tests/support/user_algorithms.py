"""A user's algorithm module, named by `--custom-algorithm-module user_algorithms` in test_algorithm_registry.py.

Nothing else imports it: its names exist only once slime has imported it from the flag.
"""

import torch

from slime.algorithms import register_advantage_estimator, register_policy_loss


@register_advantage_estimator("doubled_reward")
def doubled_reward(args, data):
    """Twice the sample's reward on every response token."""
    advantages = [torch.full(mask.shape, 2.0 * float(r)) for r, mask in zip(data["rewards"], data["loss_masks"])]
    return advantages, advantages


@register_policy_loss("plain_reinforce")
def plain_reinforce(args, log_probs, old_log_probs, advantages, loss_masks):
    """REINFORCE without a ratio: -A * log pi."""
    return -advantages * log_probs, {"mean_log_prob": log_probs.detach()}
