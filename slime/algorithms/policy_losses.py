"""Policy losses (`--loss-type`): per-token surrogate losses of the PPO family.

A policy loss sees one micro-batch, flattened over its response tokens, and returns the per-token loss
plus per-token metrics; the trainer adds the entropy bonus, the KL-to-reference loss and TIS, and reduces
everything with the step's loss aggregation (`--loss-agg-mode`). Register your own:

    @register_policy_loss("my_loss")
    def my_loss(args, log_probs, old_log_probs, advantages, loss_masks):
        ratio = torch.exp(log_probs - old_log_probs)
        return -advantages * ratio.clamp(max=2.0), {}

Conventions: `ppo_kl = old_log_probs - log_probs`, so the ratio pi/pi_old is `exp(-ppo_kl)`.
`--loss-type sft_loss` and `custom_loss` are not surrogates (no advantages, or the user's whole loss)
and are handled by the trainers themselves.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable

import torch

from slime.algorithms.advantages import ADVANTAGE_ESTIMATORS
from slime.algorithms.registry import Registry, load_from_args, origin_of

PolicyLoss = Callable[
    [Namespace, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "--loss-type")

# `--loss-type` values that are not policy surrogates; each trainer has its own implementation.
NON_POLICY_LOSS_TYPES = ("sft_loss", "custom_loss")


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering a policy loss as `--loss-type name`.

    The function is called as `fn(args, log_probs, old_log_probs, advantages, loss_masks)`: the first three
    are `[M]` tensors over the micro-batch's response tokens (`log_probs` carries the gradient), `loss_masks`
    the per-sample masks (their lengths split `[M]` into samples). It returns `(per_token_loss [M], metrics)`,
    metrics being `{name: [M] per-token values}` that are averaged over trainable tokens for logging.
    """
    if name in NON_POLICY_LOSS_TYPES:
        raise ValueError(f"--loss-type {name} is built in and not a policy loss; register yours under another name")

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES.add(name, fn, origin_of(fn))
        return fn

    return decorator


def loss_type_choices() -> list[str]:
    """Every `--loss-type` value: the registered policy losses, then `sft_loss` and `custom_loss`."""
    return [*POLICY_LOSSES.names(), *NON_POLICY_LOSS_TYPES]


def loss_kind(loss_type: str) -> str:
    """Which trainer loss implements `loss_type`: `"sft_loss"`, `"custom_loss"`, or `"policy_loss"` for all others."""
    return loss_type if loss_type in NON_POLICY_LOSS_TYPES else "policy_loss"


def resolve_policy_loss(args: Namespace) -> PolicyLoss:
    """The policy loss a run uses: `--loss-type`, except that the default `policy_loss` becomes the advantage
    estimator's own surrogate when it has one (`--advantage-estimator gspo` / `cispo`, as upstream)."""
    load_from_args(args)
    name = args.loss_type
    if name == "policy_loss":
        name = ADVANTAGE_ESTIMATORS.get(args.advantage_estimator).policy_loss or name
    return POLICY_LOSSES.get(name)


# ---------------------------------------------------------------------------------------
# The math
# ---------------------------------------------------------------------------------------


def _ppo_clip(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with optional dual clip: (losses, clip indicator, dual-clip indicator)."""
    ratio = torch.exp(-ppo_kl)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    pg_losses = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    clipfrac_lower = torch.zeros_like(clipfrac)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(
                f"eps_clip_c must be > 1 for dual-clip PPO, got {eps_clip_c}; raise --eps-clip-c or unset it"
            )
        dual_bound = -advantages * eps_clip_c
        bounded = (advantages < 0) & (dual_bound < pg_losses)
        pg_losses = torch.where(bounded, dual_bound, pg_losses)
        clipfrac_lower = bounded.float()
    return pg_losses, clipfrac, clipfrac_lower


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss per token, with optional dual clip.

    `ratio = exp(-ppo_kl)`; the loss is `max(-A * ratio, -A * clamp(ratio, 1 - eps_clip, 1 + eps_clip_high))`.
    With `eps_clip_c`, tokens with a negative advantage are additionally bounded by `-A * eps_clip_c`,
    so a huge ratio on a bad token cannot blow up the loss (dual-clip PPO).

    Args:
        ppo_kl (`torch.Tensor`):
            `old_log_probs - log_probs` per token.
        advantages (`torch.Tensor`):
            Advantage per token, same shape as `ppo_kl`.
        eps_clip (`float`):
            Lower clip range: the ratio is clipped below at `1 - eps_clip`.
        eps_clip_high (`float`):
            Upper clip range: the ratio is clipped above at `1 + eps_clip_high`.
        eps_clip_c (`float`, *optional*):
            Dual-clip constant, must be > 1.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: per-token losses, and per-token clip indicator (float 0/1,
        1 where the clipped term of the standard PPO objective is the active one).
    """
    pg_losses, clipfrac, _ = _ppo_clip(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c)
    return pg_losses, clipfrac


def compute_gspo_kl(
    log_probs: list[torch.Tensor],
    old_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
) -> torch.Tensor:
    """Sequence-level `ppo_kl` for GSPO, broadcast to every token of each sample.

    Each sample's value is the masked mean of `old_log_probs - log_probs`, so `exp(-ppo_kl)` is the
    geometric-mean sequence ratio of GSPO. Gradients use the straight-through form
    `seq_kl.detach() + (token_kl - token_kl.detach())`: the forward value is the sequence one, while
    each token's gradient comes from its own log-prob (GSPO-token). With one advantage per sequence
    and per-sample mean aggregation this is exactly GSPO's gradient, and it stays well defined when
    advantages differ per token.

    Unlike upstream's four-argument version there is no separate "local" list: context-parallel
    callers gather the full responses first.

    Args:
        log_probs (`list[torch.Tensor]`):
            Current-policy log-probs per sample, 1D over response tokens.
        old_log_probs (`list[torch.Tensor]`):
            Log-probs under the policy that generated the data, same shapes.
        loss_masks (`list[torch.Tensor]`):
            Response-token loss masks, same shapes.

    Returns:
        `torch.Tensor`: 1D concatenation over samples of the per-token `ppo_kl`, ready for
        `compute_policy_loss`.
    """
    per_sample = []
    for log_prob, old_log_prob, loss_mask in zip(log_probs, old_log_probs, loss_masks, strict=True):
        mask = loss_mask.to(log_prob.dtype)
        token_kl = old_log_prob - log_prob
        seq_kl = (token_kl * mask).sum() / mask.sum().clamp_min(1)
        per_sample.append(seq_kl.detach() + (token_kl - token_kl.detach()))
    return torch.cat(per_sample)


def compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO loss per token: `-stopgrad(min(ratio, 1 + eps_clip_high)) * A * log_probs`.

    The importance ratio is truncated and detached, so every token keeps a REINFORCE-style gradient
    (no token is dropped by clipping, unlike PPO).

    Args:
        ppo_kl (`torch.Tensor`):
            `old_log_probs - log_probs` per token.
        log_probs (`torch.Tensor`):
            Current-policy log-probs per token (carries the gradient).
        advantages (`torch.Tensor`):
            Advantage per token.
        eps_clip_high (`float`):
            The ratio is capped at `1 + eps_clip_high`.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: per-token losses, and a float 0/1 indicator of tokens whose
        ratio was capped.
    """
    ratio = torch.exp(-ppo_kl)
    capped_ratio = ratio.clamp(max=1 + eps_clip_high).detach()
    pg_losses = -capped_ratio * advantages * log_probs
    clipfrac = (ratio > 1 + eps_clip_high).float()
    return pg_losses, clipfrac


# ---------------------------------------------------------------------------------------
# Registered policy losses
# ---------------------------------------------------------------------------------------


def _ppo_metrics(
    ppo_kl: torch.Tensor, clipfrac: torch.Tensor, clipfrac_lower: torch.Tensor, args: Namespace
) -> dict[str, torch.Tensor]:
    metrics = {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl.detach()}
    if args.eps_clip_c is not None:
        metrics["pg_clipfrac_lower"] = clipfrac_lower
    return metrics


@register_policy_loss("policy_loss")
def ppo_policy_loss(
    args: Namespace,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_masks: list[torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip (`--eps-clip`, `--eps-clip-high`), dual clip with `--eps-clip-c` (metric `pg_clipfrac_lower`)."""
    ppo_kl = old_log_probs - log_probs
    losses, clipfrac, lower = _ppo_clip(ppo_kl, advantages, args.eps_clip, args.eps_clip_high, args.eps_clip_c)
    return losses, _ppo_metrics(ppo_kl, clipfrac, lower, args)


@register_policy_loss("gspo")
def gspo_policy_loss(
    args: Namespace,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_masks: list[torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip on GSPO's sequence ratio (geometric mean of the token ratios over each sample)."""
    lengths = [mask.numel() for mask in loss_masks]
    ppo_kl = compute_gspo_kl(
        list(torch.split(log_probs, lengths)), list(torch.split(old_log_probs, lengths)), loss_masks
    )
    losses, clipfrac, lower = _ppo_clip(ppo_kl, advantages, args.eps_clip, args.eps_clip_high, args.eps_clip_c)
    return losses, _ppo_metrics(ppo_kl, clipfrac, lower, args)


@register_policy_loss("cispo")
def cispo_policy_loss(
    args: Namespace,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_masks: list[torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: REINFORCE weighted by the ratio capped at `1 + --eps-clip-high` (and detached)."""
    ppo_kl = old_log_probs - log_probs
    losses, clipfrac = compute_cispo_loss(ppo_kl, log_probs, advantages, args.eps_clip_high)
    return losses, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl.detach()}
