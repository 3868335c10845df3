"""Upstream-compatible import surface for slime's RL math, which lives in `slime.algorithms`.

Code written against upstream slime (`from slime.utils.ppo_utils import compute_policy_loss`) keeps
working; new code should import from `slime.algorithms` and register new algorithms there.
"""

from slime.algorithms.advantages import (
    build_token_level_rewards,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    normalize_group_rewards,
)
from slime.algorithms.aggregation import aggregate_loss, per_token_mean, sum_of_sample_mean
from slime.algorithms.gae import (
    chunked_discounted_returns,
    chunked_gae,
    get_advantages_and_returns_batch,
    vanilla_gae,
)
from slime.algorithms.importance import compute_is_weights, vanilla_tis_function
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.logprobs import compute_entropy_from_logits, compute_log_probs
from slime.algorithms.losses import compute_sft_loss, compute_value_loss
from slime.algorithms.policy_losses import compute_cispo_loss, compute_gspo_kl, compute_policy_loss
from slime.algorithms.stats import distributed_masked_whiten, masked_mean, masked_whiten

__all__ = [
    "aggregate_loss",
    "build_token_level_rewards",
    "chunked_discounted_returns",
    "chunked_gae",
    "compute_approx_kl",
    "compute_cispo_loss",
    "compute_entropy_from_logits",
    "compute_gspo_kl",
    "compute_is_weights",
    "compute_log_probs",
    "compute_policy_loss",
    "compute_sft_loss",
    "compute_value_loss",
    "distributed_masked_whiten",
    "get_advantages_and_returns_batch",
    "get_grpo_returns",
    "get_reinforce_plus_plus_baseline_advantages",
    "get_reinforce_plus_plus_returns",
    "masked_mean",
    "masked_whiten",
    "normalize_group_rewards",
    "per_token_mean",
    "sum_of_sample_mean",
    "vanilla_gae",
    "vanilla_tis_function",
]
