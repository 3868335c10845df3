"""Importance weights pi_train / pi_rollout for the train/inference mismatch (TIS / MIS)."""

from __future__ import annotations

import math
from argparse import Namespace
from typing import Any

import torch

from slime.algorithms.kl import LOG_WEIGHT_LIMIT


def compute_is_weights(
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    *,
    level: str = "token",
    mode: str = "truncate",
    lower: float | None = None,
    upper: float = 2.0,
    veto_threshold: float | None = None,
    batch_normalize: bool = False,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Importance weights pi_train / pi_rollout correcting for the inference engine's mismatch.

    Per-token log-ratio `train_log_probs - rollout_log_probs`, aggregated by `level`:

    - `"token"`: each token its own ratio;
    - `"sequence"`: product of the ratios over trainable tokens (a sum in log space), on every token;
    - `"geometric"`: `exp(mean log-ratio)` over trainable tokens, on every token.

    then bounded by `mode`:

    - `"truncate"`: `min(w, upper)` (TIS; `lower` unused);
    - `"mask"`: `w` where `lower <= w <= upper`, else 0 (MIS);
    - `"clip"`: `clamp(w, lower, upper)`.

    With `veto_threshold`, a sample in which any trainable token has ratio `< veto_threshold` gets all
    weights 0. With `batch_normalize`, weights are rescaled so their mean over all trainable tokens
    of the batch is 1 (left as they are if that mean is 0). Log-weights are clamped to [-20, 20]
    before exp. Weights carry no gradient.

    Args:
        train_log_probs (`list[torch.Tensor]`):
            Per-sample log-probs from the trainer (the policy the loss treats as "old").
        rollout_log_probs (`list[torch.Tensor]`):
            Per-sample log-probs reported by the inference engine.
        loss_masks (`list[torch.Tensor]`):
            Per-sample response loss masks.
        level (`str`, *optional*, defaults to `"token"`):
            `"token"`, `"sequence"` or `"geometric"`.
        mode (`str`, *optional*, defaults to `"truncate"`):
            `"truncate"`, `"mask"` or `"clip"`.
        lower (`float`, *optional*):
            Lower bound for `"mask"` / `"clip"`; defaults to `1 / upper`.
        upper (`float`, *optional*, defaults to `2.0`):
            Upper bound.
        veto_threshold (`float`, *optional*):
            Per-token ratio below which the whole sample is rejected.
        batch_normalize (`bool`, *optional*, defaults to `False`):
            Rescale to a masked mean of 1.

    Returns:
        `tuple[list[torch.Tensor], dict[str, torch.Tensor]]`: per-sample float32 weights, and 0-d metrics:
        `is_raw_weight_mean` (masked mean before bounding), `is_clipfrac` (fraction of trainable tokens
        whose weight the mode changed), `is_veto_fraction` (fraction of samples vetoed) and
        `is_weight_mean` (masked mean of the returned weights).
    """
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"unknown IS level {level!r}; use 'token', 'sequence' or 'geometric'")
    if mode not in ("truncate", "mask", "clip"):
        raise ValueError(f"unknown IS mode {mode!r}; use 'truncate', 'mask' or 'clip'")
    if upper <= 0:
        raise ValueError(f"IS upper bound must be > 0, got {upper}")
    if lower is None:
        lower = 1.0 / upper
    if not 0 <= lower <= upper:
        raise ValueError(f"IS bounds must satisfy 0 <= lower <= upper, got lower={lower}, upper={upper}")
    if veto_threshold is not None and veto_threshold <= 0:
        raise ValueError(f"veto_threshold must be > 0 (a ratio), got {veto_threshold}; unset it to disable the veto")

    weights, raw_weights, bounded, masks, vetoed = [], [], [], [], []
    for train_lp, rollout_lp, loss_mask in zip(train_log_probs, rollout_log_probs, loss_masks, strict=True):
        log_ratio = train_lp.detach().float() - rollout_lp.detach().float()
        mask = loss_mask.to(log_ratio.device, torch.float32)
        if level == "token":
            log_weight = log_ratio
        else:
            seq_log_ratio = (log_ratio * mask).sum()
            if level == "geometric":
                seq_log_ratio = seq_log_ratio / mask.sum().clamp_min(1)
            log_weight = seq_log_ratio.expand_as(log_ratio)
        raw = torch.exp(log_weight.clamp(-LOG_WEIGHT_LIMIT, LOG_WEIGHT_LIMIT))

        if mode == "truncate":
            weight = raw.clamp(max=upper)
        elif mode == "clip":
            weight = raw.clamp(lower, upper)
        else:
            weight = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
        bounded.append((weight != raw).float())

        is_vetoed = torch.zeros((), dtype=torch.bool, device=log_ratio.device)
        if veto_threshold is not None:
            is_vetoed = ((log_ratio < math.log(veto_threshold)) & (mask > 0)).any()
            weight = torch.where(is_vetoed, 0.0, weight)

        weights.append(weight)
        raw_weights.append(raw)
        masks.append(mask)
        vetoed.append(is_vetoed)

    all_mask = torch.cat(masks)
    token_count = all_mask.sum().clamp_min(1)
    all_raw = torch.cat(raw_weights)
    all_weights = torch.cat(weights)
    if batch_normalize:
        weight_mean = (all_weights * all_mask).sum() / token_count
        scale = torch.where(weight_mean > 0, 1 / weight_mean.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
        weights = [w * scale for w in weights]
        all_weights = all_weights * scale

    metrics = {
        "is_raw_weight_mean": (all_raw * all_mask).sum() / token_count,
        "is_clipfrac": (torch.cat(bounded) * all_mask).sum() / token_count,
        "is_veto_fraction": torch.stack(vetoed).float().mean(),
        "is_weight_mean": (all_weights * all_mask).sum() / token_count,
    }
    return weights, metrics


def vanilla_tis_function(
    args: Namespace,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Truncated importance sampling for `--use-tis`: scale each token's policy loss by
    `clamp(exp(train - rollout), args.tis_clip_low, args.tis_clip)`.

    Has the `--custom-tis-function-path` signature, so it is also the template for user variants;
    extra keyword arguments (`total_lengths`, `response_lengths`) are accepted and unused.

    Args:
        args (`Namespace`):
            Needs `tis_clip` (upper bound) and `tis_clip_low` (lower bound).
        pg_loss (`torch.Tensor`):
            1D per-token policy loss, the concatenation of the samples in order.
        train_log_probs (`list[torch.Tensor]`):
            Per-sample log-probs from the trainer.
        rollout_log_probs (`list[torch.Tensor]`):
            Per-sample log-probs from the inference engine.
        loss_masks (`list[torch.Tensor]`):
            Per-sample response loss masks.

    Returns:
        `tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]`: the weighted per-token loss,
        the loss masks (unchanged), and the metrics of `compute_is_weights` renamed to `tis_*`.
    """
    return _token_ratio_weighted(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, mode="clip")


def icepop_function(
    args: Namespace,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """IcePop, upstream's masking alternative to `--use-tis`'s truncation, for both backends:
    `--custom-tis-function-path slime.algorithms.importance.icepop_function` (or upstream's path,
    `slime.backends.megatron_utils.loss.icepop_function`).

    Each token's policy loss is weighted by its ratio r = exp(train - rollout) when `tis_clip_low <= r <= tis_clip`
    and by 0 outside that band (`compute_is_weights`, token level, "mask" mode). Truncation keeps an out-of-band
    token at the bound; IcePop drops it. With the band [0.5, 2], a token the engine sampled with probability 0.01
    that the trainer gives 0.1 (r = 10) adds nothing to the gradient, where truncation would still weight it by 2:
    such tokens measure the engine/trainer mismatch more than the policy. In-band tokens (r = 1.2) get r under both.

    Args and returns as `vanilla_tis_function`'s; `tis_clipfrac` is the share of trainable tokens dropped.
    """
    return _token_ratio_weighted(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, mode="mask")


def _token_ratio_weighted(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, mode: str):
    """`pg_loss` weighted per token by `compute_is_weights` in `mode`, with its metrics renamed `tis_*`."""
    weights, metrics = compute_is_weights(
        train_log_probs,
        rollout_log_probs,
        loss_masks,
        level="token",
        mode=mode,
        lower=args.tis_clip_low,
        upper=args.tis_clip,
    )
    weighted = pg_loss * torch.cat(weights).to(pg_loss.dtype)
    return weighted, loss_masks, {"tis" + name.removeprefix("is"): value for name, value in metrics.items()}
