"""Losses of one FSDP micro-batch from the response logits: policy, SFT and custom (value loss for the critic).

The current policy's log-probs and entropies come from the `[M, vocab]` response logits; the loss
assembly and the step normalizer are backend-neutral (`slime.algorithms.losses`). FSDP averages gradients
over ranks, so the trainer multiplies the loss by the data-parallel size before `backward`.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable

import torch

from slime.algorithms.aggregation import StepNormalizer
from slime.algorithms.logprobs import compute_entropy_from_logits, compute_log_probs
from slime.algorithms.losses import Metrics, policy_loss_from_log_probs, sft_loss_from_log_probs
from slime.utils.misc import load_function


def policy_loss(
    args: Namespace, batch: dict, logits: torch.Tensor, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """PPO-family policy loss, plus entropy bonus and KL-to-reference loss.

    Args:
        args: `advantage_estimator` (gspo / cispo change the ratio and the loss), `eps_clip`, `eps_clip_high`,
            `eps_clip_c`, `use_tis` (+ `custom_tis_function_path`, `tis_clip`, `tis_clip_low`), `entropy_coef`,
            `use_kl_loss`, `kl_loss_coef`, `kl_loss_type`, `use_unbiased_kl`.
        batch: Per-sample lists for the micro-batch, named as in the rollout data: `log_probs` (of the policy
            that generated the data: the "old" log-probs), `advantages`, `loss_masks`, `ref_log_probs` (with
            `use_kl_loss`), `rollout_log_probs` (with `use_tis`), `rewards`, `tokens`, ...; plus `target_tokens`
            (`[M]`), `response_lengths` and `total_lengths`.
        logits: `[M, vocab]` response logits already divided by the temperature.
        normalizer: The step's denominators.

    Returns:
        (loss to backpropagate, metrics: loss, pg_loss, pg_clipfrac, ppo_kl, entropy, kl_loss, tis_*).
    """
    flat_log_probs = compute_log_probs(logits, batch["target_tokens"])
    with torch.set_grad_enabled(torch.is_grad_enabled() and args.entropy_coef != 0):
        entropy = compute_entropy_from_logits(logits)
    return policy_loss_from_log_probs(args, batch, flat_log_probs, entropy, normalizer)


def sft_loss(
    args: Namespace, batch: dict, logits: torch.Tensor, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """Negative log-likelihood of the trainable response tokens (`--loss-type sft_loss`)."""
    return sft_loss_from_log_probs(batch, compute_log_probs(logits, batch["target_tokens"]), normalizer)


def custom_loss(
    args: Namespace, batch: dict, logits: torch.Tensor, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """`--custom-loss-function-path`: `f(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)`.

    `batch` is the micro-batch dict described in `policy_loss`, `logits` the `[M, vocab]` response
    logits (temperature applied), and `sum_of_sample_mean(per_token_values)` the step's reducer
    bound to the batch's loss masks: use it so the loss sums correctly over micro-batches and
    ranks. Returned metrics are summed the same way, so reduce them with it too.
    """
    function = load_function(args.custom_loss_function_path)

    def reducer(per_token_values: list[torch.Tensor]) -> torch.Tensor:
        return normalizer.reduce(per_token_values, batch["loss_masks"])

    loss, metrics = function(args, batch, logits, reducer)
    return loss, {"loss": loss.detach(), **{name: torch.as_tensor(value).detach() for name, value in metrics.items()}}


LOSS_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, Metrics]]] = {
    "policy_loss": policy_loss,
    "sft_loss": sft_loss,
    "custom_loss": custom_loss,
}
