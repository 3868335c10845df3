"""Masked importance sampling (MIS) for the train/inference mismatch, with truncated IS (TIS) on what is kept.

    --use-tis --custom-tis-function-path mis.mis_function   (mis.yaml sets both, and the bounds below)

The engine that sampled a token and the trainer disagree a little on its probability; the ratio
r = pi_train / pi_rollout measures by how much. MIS drops the tokens (or whole samples) whose ratio at
`mis_level` is outside [`mis_lower_bound`, `mis_upper_bound`] from the loss; the kept tokens' policy loss
is weighted by min(r, `tis_clip`). Settings come from `--custom-config-path` keys (defaults in brackets):

- `mis_level` [token]: `token` (each token's r), `sequence` (the product over the sample's trainable
  tokens, applied to all of them) or `geometric` (that product's per-token geometric mean);
- `mis_lower_bound` [0.5; null means 1 / `mis_upper_bound`], `mis_upper_bound` [2.0];
- `mis_veto_threshold` [None]: a sample with any trainable token's r below it is dropped whole.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from typing import Any

import torch

from slime.algorithms.importance import compute_is_weights


@dataclass(frozen=True)
class MisConfig:
    """The MIS settings, read from args (set by `--custom-config-path` keys)."""

    level: str = "token"
    lower: float = 0.5
    upper: float = 2.0
    veto_threshold: float | None = None

    @classmethod
    def from_args(cls, args: Namespace) -> MisConfig:
        """Read `mis_level`, `mis_lower_bound`, `mis_upper_bound`, `mis_veto_threshold` from `args`.

        Raises:
            ValueError: A setting is out of range; the message names the key to fix.
        """
        values = {
            "mis_level": getattr(args, "mis_level", cls.level),
            "mis_lower_bound": getattr(args, "mis_lower_bound", cls.lower),
            "mis_upper_bound": getattr(args, "mis_upper_bound", cls.upper),
            "mis_veto_threshold": getattr(args, "mis_veto_threshold", cls.veto_threshold),
        }
        for key in ("mis_lower_bound", "mis_upper_bound", "mis_veto_threshold"):
            if values[key] is not None and (isinstance(values[key], bool) or not isinstance(values[key], int | float)):
                # YAML reads 1e-4 (no dot) as a string: write 1.0e-4.
                raise ValueError(f"{key} is {values[key]!r}, not a number; write it as e.g. 0.5 or 1.0e-4")
        config = cls(*values.values())
        if config.level not in ("token", "sequence", "geometric"):
            raise ValueError(f"mis_level is {config.level!r}; use token, sequence or geometric")
        if config.upper is None or not 0 <= (config.lower or 0) <= config.upper:
            raise ValueError(
                f"mis_lower_bound ({config.lower}) and mis_upper_bound ({config.upper}) must satisfy "
                "0 <= mis_lower_bound <= mis_upper_bound"
            )
        if config.veto_threshold is not None and not config.veto_threshold > 0:
            raise ValueError(f"mis_veto_threshold is {config.veto_threshold}; use a ratio > 0, or null to disable it")
        return config


def mis_function(
    args: Namespace,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """`--custom-tis-function-path`: mask out-of-bounds tokens (MIS), weight the rest by min(r, `args.tis_clip`).

    Args:
        args: `tis_clip` and the `mis_*` settings (see `MisConfig.from_args`).
        pg_loss: 1D per-token policy loss, the samples concatenated in order.
        train_log_probs: Per-sample log-probs from the trainer.
        rollout_log_probs: Per-sample log-probs from the engine.
        loss_masks: Per-sample response loss masks.
        **kwargs: `total_lengths`, `response_lengths` (unused).

    Returns:
        The weighted per-token loss, the loss masks with dropped tokens set to 0, and metrics, each a
        mean or fraction over the trainable tokens: `mis_ratio_mean` (r at `mis_level`, before bounds),
        `mis_masked_fraction` (dropped, by bounds or veto), `mis_veto_fraction` (in vetoed samples) and
        `tis_clipfrac` (kept, with their weight cut to `tis_clip`).
    """
    config = MisConfig.from_args(args)
    in_bounds, mask_metrics = compute_is_weights(
        train_log_probs, rollout_log_probs, loss_masks, level=config.level, mode="mask", lower=config.lower,
        upper=config.upper,
    )  # fmt: skip
    # TIS: each token's own ratio, truncated. The veto zeroes a whole sample; any other weight is exp(...) > 0.
    tis_weights, _ = compute_is_weights(
        train_log_probs, rollout_log_probs, loss_masks, mode="truncate", upper=args.tis_clip,
        veto_threshold=config.veto_threshold,
    )  # fmt: skip
    new_masks, vetoed, clipped = [], [], []
    for mask, bounded, weight in zip(loss_masks, in_bounds, tis_weights, strict=True):
        trainable, not_vetoed = mask > 0, weight > 0
        keep = trainable & (bounded > 0) & not_vetoed
        new_masks.append(keep.to(mask.dtype))
        vetoed.append(trainable & ~not_vetoed)
        clipped.append(keep & (weight >= args.tis_clip))

    num_trainable = sum(mask.sum() for mask in loss_masks).clamp_min(1)
    metrics = {
        "mis_ratio_mean": mask_metrics["is_raw_weight_mean"],
        "mis_masked_fraction": 1 - sum(mask.sum() for mask in new_masks) / num_trainable,
        "mis_veto_fraction": torch.cat(vetoed).sum() / num_trainable,
        "tis_clipfrac": torch.cat(clipped).sum() / num_trainable,
    }
    return pg_loss * torch.cat(tis_weights).to(pg_loss.dtype), new_masks, metrics
