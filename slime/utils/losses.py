"""Moved to `slime.algorithms.losses` and `slime.algorithms.aggregation`; this path keeps working."""

from slime.algorithms.aggregation import StepNormalizer, count_step_samples_and_tokens
from slime.algorithms.losses import Metrics, policy_loss_from_log_probs, sft_loss_from_log_probs, value_loss

__all__ = [
    "Metrics",
    "StepNormalizer",
    "count_step_samples_and_tokens",
    "policy_loss_from_log_probs",
    "sft_loss_from_log_probs",
    "value_loss",
]
