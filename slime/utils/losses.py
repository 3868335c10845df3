"""Backend-neutral loss assembly of one micro-batch: the step normalizer and the policy / SFT / value losses.

Both trainers produce the current policy's log-probs (and entropies) of the response tokens their own
way (FSDP from full logits, Megatron from vocab-parallel logits); from there the losses are the same.

Aggregation. Every per-token quantity is reduced with the step's `StepNormalizer`, whose
denominators count the whole optimizer step over all data-parallel ranks:

- default: sum over samples of each sample's masked token mean, divided by the step's sample
  count (the mean over the global batch of per-sample means);
- `--calculate-per-token-loss`: masked token sum divided by the step's trainable-token count.

So the micro-batch values add up, over micro-batches and ranks, to the global-batch value no
matter how the batch was split. Metrics are reduced the same way and are summed by the trainer.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass

import torch

from slime.utils.micro_batches import split_per_sample
from slime.utils.misc import load_function
from slime.utils.ppo_utils import (
    compute_approx_kl,
    compute_cispo_loss,
    compute_gspo_kl,
    compute_policy_loss,
    compute_value_loss,
    per_token_mean,
    sum_of_sample_mean,
    vanilla_tis_function,
)

Metrics = dict[str, torch.Tensor]


@dataclass
class StepNormalizer:
    """Denominators of one optimizer step, counted over every data-parallel rank.

    Attributes:
        num_samples: Samples in the step (the global batch size).
        num_tokens: Trainable (loss-mask) tokens in the step.
        per_token: `--calculate-per-token-loss`.
    """

    num_samples: int
    num_tokens: int
    per_token: bool = False

    def reduce(self, per_token_values: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> torch.Tensor:
        """This micro-batch's share of the step's aggregate of `per_token_values`."""
        if self.per_token:
            return per_token_mean(per_token_values, loss_masks, num_tokens=max(self.num_tokens, 1))
        return sum_of_sample_mean(per_token_values, loss_masks, num_samples=self.num_samples)

    def token_share(self, loss_masks: list[torch.Tensor]) -> float:
        """Fraction of the step's trainable tokens in this micro-batch (weights token-mean metrics)."""
        return float(sum(mask.sum() for mask in loss_masks)) / max(self.num_tokens, 1)


def count_step_samples_and_tokens(step_sample_indices: list[list[int]], loss_masks: list[torch.Tensor]) -> torch.Tensor:
    """`[num_steps, 2]` float64: each step's sample count and trainable-token count on this rank.

    Sum it over the data-parallel ranks, then build each step's `StepNormalizer` from its row.
    """
    counts = torch.zeros(len(step_sample_indices), 2, dtype=torch.float64)
    for step, indices in enumerate(step_sample_indices):
        counts[step, 0] = len(indices)
        counts[step, 1] = sum(float(loss_masks[i].sum()) for i in indices)
    return counts


def policy_loss_from_log_probs(
    args: Namespace, batch: dict, flat_log_probs: torch.Tensor, entropy: torch.Tensor, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """PPO-family policy loss (PPO / GSPO / CISPO, TIS), plus entropy bonus and KL-to-reference loss.

    Args:
        args: `advantage_estimator` (gspo / cispo change the ratio and the loss), `eps_clip`, `eps_clip_high`,
            `eps_clip_c`, `use_tis` (+ `custom_tis_function_path`, `tis_clip`, `tis_clip_low`), `entropy_coef`,
            `use_kl_loss`, `kl_loss_coef`, `kl_loss_type`, `use_unbiased_kl`.
        batch: Per-sample lists for the micro-batch, named as in the rollout data: `log_probs` (of the policy
            that generated the data: the "old" log-probs), `advantages`, `loss_masks`, `ref_log_probs` (with
            `use_kl_loss`), `rollout_log_probs` (with `use_tis`), ...; plus `response_lengths` and `total_lengths`.
        flat_log_probs: `[M]` the current policy's log-probs of the response tokens.
        entropy: `[M]` the current policy's entropies there (with gradient only when `entropy_coef` is non-zero).
        normalizer: The step's denominators.

    Returns:
        (loss to backpropagate, metrics: loss, pg_loss, pg_clipfrac, ppo_kl, entropy, kl_loss, tis_*).
    """
    lengths, masks = batch["response_lengths"], batch["loss_masks"]
    log_probs = split_per_sample(flat_log_probs, lengths)
    old_log_probs = batch["log_probs"]
    advantages = torch.cat(batch["advantages"])

    if args.advantage_estimator == "gspo":
        ppo_kl = compute_gspo_kl(log_probs, old_log_probs, masks)
    else:
        ppo_kl = torch.cat(old_log_probs) - flat_log_probs
    if args.advantage_estimator == "cispo":
        pg_losses, clipfrac = compute_cispo_loss(ppo_kl, flat_log_probs, advantages, args.eps_clip_high)
    else:
        pg_losses, clipfrac = compute_policy_loss(
            ppo_kl, advantages, args.eps_clip, args.eps_clip_high, args.eps_clip_c
        )

    metrics: Metrics = {}
    pg_masks = masks
    if args.use_tis:
        tis_path = getattr(args, "custom_tis_function_path", None)
        tis_function = load_function(tis_path) if tis_path else vanilla_tis_function
        pg_losses, pg_masks, tis_metrics = tis_function(
            args,
            pg_loss=pg_losses,
            train_log_probs=old_log_probs,
            rollout_log_probs=batch["rollout_log_probs"],
            loss_masks=masks,
            total_lengths=batch["total_lengths"],
            response_lengths=lengths,
        )
        share = normalizer.token_share(masks)
        metrics |= {name: value.detach() * share for name, value in tis_metrics.items()}

    pg_loss = normalizer.reduce(split_per_sample(pg_losses, lengths), pg_masks)
    entropy_loss = normalizer.reduce(split_per_sample(entropy, lengths), masks)
    loss = pg_loss - args.entropy_coef * entropy_loss

    if args.use_kl_loss:
        ratio = torch.exp(flat_log_probs - torch.cat(old_log_probs)).detach() if args.use_unbiased_kl else None
        kl = compute_approx_kl(
            flat_log_probs, torch.cat(batch["ref_log_probs"]), args.kl_loss_type, importance_ratio=ratio
        )
        kl_loss = normalizer.reduce(split_per_sample(kl, lengths), masks)
        loss = loss + args.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()

    metrics |= {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": normalizer.reduce(split_per_sample(clipfrac, lengths), masks).detach(),
        "ppo_kl": normalizer.reduce(split_per_sample(ppo_kl.detach(), lengths), masks).detach(),
        "entropy": entropy_loss.detach(),
    }
    return loss, metrics


def sft_loss_from_log_probs(
    batch: dict, flat_log_probs: torch.Tensor, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """Negative log-likelihood of the trainable response tokens (`--loss-type sft_loss`).

    Args:
        batch: Needs `response_lengths` and `loss_masks`.
        flat_log_probs: `[M]` the current policy's log-probs of the response tokens.
        normalizer: The step's denominators.
    """
    log_probs = split_per_sample(flat_log_probs, batch["response_lengths"])
    loss = normalizer.reduce([-lp for lp in log_probs], batch["loss_masks"])
    return loss, {"loss": loss.detach()}


def value_loss(
    args: Namespace, batch: dict, values: torch.Tensor, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss of the critic on the returns (`--value-clip`).

    Args:
        args: Needs `value_clip`.
        batch: Per-sample `values` (the critic's values when the data was scored), `returns`, `loss_masks`,
            and `response_lengths`.
        values: `[M]` current critic values at the positions predicting each response token.
        normalizer: The step's denominators.

    Returns:
        (loss, metrics: value_loss, value_clipfrac).
    """
    lengths, masks = batch["response_lengths"], batch["loss_masks"]
    losses, clipfrac = compute_value_loss(
        values, torch.cat(batch["values"]), torch.cat(batch["returns"]), args.value_clip
    )
    loss = normalizer.reduce(split_per_sample(losses, lengths), masks)
    clipped = normalizer.reduce(split_per_sample(clipfrac, lengths), masks)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipped.detach()}
