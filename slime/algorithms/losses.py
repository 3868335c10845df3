"""One micro-batch's loss from the current policy's log-probs: policy (PPO family), SFT and value losses.

Both trainers produce the current policy's log-probs (and entropies) of the response tokens their own
way (FSDP from full logits, Megatron from vocab-parallel logits); from there the losses are the same.
Every per-token term is reduced with the step's `StepNormalizer` (`--loss-agg-mode`), whose denominators
count the whole optimizer step over all data-parallel ranks, so the micro-batch values add up, over
micro-batches and ranks, to the global-batch value no matter how the batch was split. Metrics are
averaged the same way and are summed by the trainer.
"""

from __future__ import annotations

from argparse import Namespace

import torch

from slime.algorithms.aggregation import StepNormalizer, aggregate_loss
from slime.algorithms.importance import vanilla_tis_function
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.policy_losses import resolve_policy_loss
from slime.algorithms.registry import import_object

Metrics = dict[str, torch.Tensor]


def _per_sample(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, lengths))


def policy_loss_from_log_probs(
    args: Namespace, batch: dict, flat_log_probs: torch.Tensor, entropy: torch.Tensor, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """Policy loss (the `--loss-type` surrogate, TIS), plus entropy bonus and KL-to-reference loss.

    Args:
        args: `loss_type` / `advantage_estimator` (which surrogate, see `resolve_policy_loss`) and the flags it
            reads (`eps_clip`, `eps_clip_high`, `eps_clip_c`), `use_tis` (+ `custom_tis_function_path`,
            `tis_clip`, `tis_clip_low`), `entropy_coef`, `use_kl_loss`, `kl_loss_coef`, `kl_loss_type`,
            `use_unbiased_kl`.
        batch: Per-sample lists for the micro-batch, named as in the rollout data: `log_probs` (of the policy
            that generated the data: the "old" log-probs), `advantages`, `loss_masks`, `ref_log_probs` (with
            `use_kl_loss`), `rollout_log_probs` (with `use_tis`), ...; plus `response_lengths` and `total_lengths`.
        flat_log_probs: `[M]` the current policy's log-probs of the response tokens.
        entropy: `[M]` the current policy's entropies there (with gradient only when `entropy_coef` is non-zero).
        normalizer: The step's denominators.

    Returns:
        (loss to backpropagate, metrics: loss, pg_loss, entropy, kl_loss, the surrogate's own (pg_clipfrac,
        pg_clipfrac_lower, ppo_kl for the built-ins), tis_*).
    """
    lengths, masks = batch["response_lengths"], batch["loss_masks"]
    old_log_probs = batch["log_probs"]
    flat_old = torch.cat(old_log_probs)
    pg_losses, pg_metrics = resolve_policy_loss(args)(
        args, flat_log_probs, flat_old, torch.cat(batch["advantages"]), masks
    )

    metrics: Metrics = {}
    pg_masks = masks
    if args.use_tis:
        tis_path = args.custom_tis_function_path
        tis_function = import_object(tis_path, "--custom-tis-function-path") if tis_path else vanilla_tis_function
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

    pg_loss = normalizer.reduce(_per_sample(pg_losses, lengths), pg_masks)
    entropy_per_sample = _per_sample(entropy, lengths)
    loss = pg_loss
    if args.entropy_coef != 0:
        loss = loss - args.entropy_coef * normalizer.reduce(entropy_per_sample, masks)

    if args.use_kl_loss:
        ratio = torch.exp(flat_log_probs - flat_old).detach() if args.use_unbiased_kl else None
        kl = compute_approx_kl(
            flat_log_probs, torch.cat(batch["ref_log_probs"]), args.kl_loss_type, importance_ratio=ratio
        )
        kl_loss = normalizer.reduce(_per_sample(kl, lengths), masks)
        loss = loss + args.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()

    metrics |= {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "entropy": normalizer.mean([e.detach() for e in entropy_per_sample], masks),
    }
    for name, values in pg_metrics.items():
        metrics[name] = normalizer.mean(_per_sample(values.detach().float(), lengths), masks)
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
    log_probs = _per_sample(flat_log_probs, batch["response_lengths"])
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
    loss = normalizer.reduce(_per_sample(losses, lengths), masks)
    clipped = normalizer.mean(_per_sample(clipfrac, lengths), masks)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": clipped.detach()}


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token: `0.5 * max((v - R)^2, (v_clipped - R)^2)`.

    `v_clipped = old_values + clamp(values - old_values, -value_clip, value_clip)`.

    Args:
        values (`torch.Tensor`):
            Current critic outputs per token.
        old_values (`torch.Tensor`):
            Critic outputs when the data was generated.
        returns (`torch.Tensor`):
            Return targets per token.
        value_clip (`float`):
            Largest allowed move of the value away from `old_values`.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: per-token losses, and a float 0/1 indicator of tokens where
        the clipped term is the larger one.
    """
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped_error = (values - returns).pow(2)
    clipped_error = (clipped_values - returns).pow(2)
    loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
    clipfrac = (clipped_error > unclipped_error).float()
    return loss, clipfrac


def compute_sft_loss(
    log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    per_token: bool = False,
) -> torch.Tensor:
    """SFT loss: negative log-likelihood of the trainable tokens, aggregated like `aggregate_loss`.

    Args:
        log_probs (`list[torch.Tensor]`):
            Per-sample log-probs of the response tokens.
        loss_masks (`list[torch.Tensor]`):
            Per-sample loss masks, same shapes.
        per_token (`bool`, *optional*, defaults to `False`):
            Average over tokens instead of over samples.

    Returns:
        `torch.Tensor`: Scalar loss.
    """
    return aggregate_loss([-log_prob for log_prob in log_probs], loss_masks, per_token)
