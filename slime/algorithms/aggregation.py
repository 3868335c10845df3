"""Loss aggregation (`--loss-agg-mode`): how per-token values of an optimizer step become one scalar.

Every mode divides by counts of the *whole step* over all data-parallel ranks (`StepCounts`), so the
values of the micro-batches add up to the step's value however the batch was split. Built-ins, with
`N` samples and `T` trainable tokens in the step, `x_it` the value of token t of sample i over its mask:

- `seq-mean-token-mean` (default): `sum_i mean_t x_it / N`; short and long responses weigh the same.
- `token-mean` (`--calculate-per-token-loss`): `sum_it x_it / T`; DAPO-style, longer responses weigh more.
- `seq-mean-token-sum`: `sum_it x_it / N`.
- `seq-mean-token-sum-norm` (Dr. GRPO): `sum_it x_it / (N * L)` with the constant `L =
  --rollout-max-response-len`, so no length bias and no per-batch token count.

Register your own as `fn(per_token_values, loss_masks, counts) -> scalar`:

    @register_loss_aggregation("seq-sum")
    def seq_sum(values, masks, counts):
        return sum((v * m).sum() for v, m in zip(values, masks))
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slime.algorithms.registry import Registry, load_from_args, origin_of


@dataclass(frozen=True)
class StepCounts:
    """Denominators of one optimizer step, counted over every data-parallel rank.

    Attributes:
        num_samples: Samples in the step (the global batch size).
        num_tokens: Trainable (loss-mask) tokens in the step.
        horizon: The constant response length of `seq-mean-token-sum-norm` (`--rollout-max-response-len`).
    """

    num_samples: int
    num_tokens: int
    horizon: int | None = None


Aggregation = Callable[[list[torch.Tensor], list[torch.Tensor], StepCounts], torch.Tensor]

LOSS_AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation", "--loss-agg-mode")


def register_loss_aggregation(name: str) -> Callable[[Aggregation], Aggregation]:
    """Decorator registering `fn(per_token_values, loss_masks, counts) -> scalar` as `--loss-agg-mode name`.

    `per_token_values` and `loss_masks` are per-sample 1D lists for one micro-batch; `counts` holds the
    step's totals. The result must be this micro-batch's share, so that the shares sum to the step's value.
    """

    def decorator(fn: Aggregation) -> Aggregation:
        LOSS_AGGREGATIONS.add(name, fn, origin_of(fn))
        return fn

    return decorator


def _masked_sums(per_token_losses: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> list[torch.Tensor]:
    if len(per_token_losses) != len(loss_masks):
        raise ValueError(f"got {len(per_token_losses)} per-token tensors for {len(loss_masks)} loss masks")
    return [(loss * mask.to(loss.dtype)).sum() for loss, mask in zip(per_token_losses, loss_masks, strict=True)]


def sum_of_sample_mean(
    per_token_losses: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    num_samples: int | None = None,
) -> torch.Tensor:
    """Sum over samples of each sample's masked token mean, divided by `num_samples`.

    With the default `num_samples` (the number of samples given) this is the mean over samples of
    the per-sample mean, so short and long responses weigh the same. Trainers that accumulate
    gradients over micro-batches pass the sample count of the whole step instead, so that the
    micro-batch losses add up to the step's mean. A sample with an empty mask contributes 0.

    Args:
        per_token_losses (`list[torch.Tensor]`):
            Per-sample 1D per-token losses.
        loss_masks (`list[torch.Tensor]`):
            Per-sample loss masks, same shapes.
        num_samples (`int`, *optional*):
            Denominator; defaults to `len(per_token_losses)`.

    Returns:
        `torch.Tensor`: Scalar loss.
    """
    if not per_token_losses:
        raise ValueError("sum_of_sample_mean got no samples")
    sample_means = [
        (loss * mask.to(loss.dtype)).sum() / mask.sum().clamp_min(1)
        for loss, mask in zip(per_token_losses, loss_masks, strict=True)
    ]
    return torch.stack(sample_means).sum() / (num_samples or len(sample_means))


def per_token_mean(
    per_token_losses: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Masked token sum over all samples divided by the number of trainable tokens (DAPO-style).

    Longer responses weigh more. Trainers that accumulate over micro-batches pass the token count of
    the whole step as `num_tokens`.

    Args:
        per_token_losses (`list[torch.Tensor]`):
            Per-sample 1D per-token losses.
        loss_masks (`list[torch.Tensor]`):
            Per-sample loss masks, same shapes.
        num_tokens (`int`, *optional*):
            Denominator; defaults to the total of the masks (at least 1).

    Returns:
        `torch.Tensor`: Scalar loss.
    """
    if not per_token_losses:
        raise ValueError("per_token_mean got no samples")
    losses = torch.cat(per_token_losses)
    mask = torch.cat([m.to(losses.dtype) for m in loss_masks])
    if losses.shape != mask.shape:
        raise ValueError(f"per_token_losses and loss_masks hold {losses.numel()} vs {mask.numel()} tokens")
    denominator = num_tokens if num_tokens is not None else mask.sum().clamp_min(1)
    return (losses * mask).sum() / denominator


def aggregate_loss(
    per_token_losses: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    per_token: bool = False,
) -> torch.Tensor:
    """`per_token_mean` when `per_token` (`--calculate-per-token-loss`), else `sum_of_sample_mean`.

    Args:
        per_token_losses (`list[torch.Tensor]`):
            Per-sample 1D per-token losses.
        loss_masks (`list[torch.Tensor]`):
            Per-sample loss masks, same shapes.
        per_token (`bool`, *optional*, defaults to `False`):
            Average over tokens instead of over samples.

    Returns:
        `torch.Tensor`: Scalar loss.
    """
    if per_token:
        return per_token_mean(per_token_losses, loss_masks)
    return sum_of_sample_mean(per_token_losses, loss_masks)


@register_loss_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(values: list[torch.Tensor], masks: list[torch.Tensor], counts: StepCounts) -> torch.Tensor:
    """Mean over the step's samples of each sample's masked token mean."""
    return sum_of_sample_mean(values, masks, num_samples=max(counts.num_samples, 1))


@register_loss_aggregation("token-mean")
def token_mean(values: list[torch.Tensor], masks: list[torch.Tensor], counts: StepCounts) -> torch.Tensor:
    """Masked token sum over the step's trainable-token count."""
    return per_token_mean(values, masks, num_tokens=max(counts.num_tokens, 1))


@register_loss_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(values: list[torch.Tensor], masks: list[torch.Tensor], counts: StepCounts) -> torch.Tensor:
    """Mean over the step's samples of each sample's masked token sum."""
    return torch.stack(_masked_sums(values, masks)).sum() / max(counts.num_samples, 1)


@register_loss_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(values: list[torch.Tensor], masks: list[torch.Tensor], counts: StepCounts) -> torch.Tensor:
    """Dr. GRPO: masked token sum over `num_samples * horizon`, the horizon a constant response length."""
    if not counts.horizon or counts.horizon < 1:
        raise ValueError(
            "--loss-agg-mode seq-mean-token-sum-norm divides by a constant response length; "
            "pass --rollout-max-response-len"
        )
    return torch.stack(_masked_sums(values, masks)).sum() / (max(counts.num_samples, 1) * counts.horizon)


def default_loss_agg_mode(args: Namespace) -> str:
    """`--loss-agg-mode`, or when unset `token-mean` with `--calculate-per-token-loss`, else `seq-mean-token-mean`."""
    if args.loss_agg_mode:
        return args.loss_agg_mode
    return "token-mean" if args.calculate_per_token_loss else "seq-mean-token-mean"


@dataclass
class StepNormalizer:
    """Reduces one micro-batch's per-token values to its share of the optimizer step's aggregate.

    Attributes:
        num_samples: Samples in the step (the global batch size), over all data-parallel ranks.
        num_tokens: Trainable (loss-mask) tokens in the step, over all data-parallel ranks.
        per_token: `--calculate-per-token-loss`; picks `token-mean` when `mode` is not given.
        mode: The `--loss-agg-mode` of loss terms (default: from `per_token`).
        horizon: The constant response length of `seq-mean-token-sum-norm` (`--rollout-max-response-len`).
    """

    num_samples: int
    num_tokens: int
    per_token: bool = False
    mode: str | None = None
    horizon: int | None = None

    def __post_init__(self):
        if self.mode is None:
            self.mode = "token-mean" if self.per_token else "seq-mean-token-mean"
        self.counts = StepCounts(self.num_samples, self.num_tokens, self.horizon)

    @classmethod
    def from_args(cls, args: Namespace, num_samples: int, num_tokens: int) -> StepNormalizer:
        """The step's normalizer under `args` (`--loss-agg-mode`, `--rollout-max-response-len`)."""
        load_from_args(args)
        mode = default_loss_agg_mode(args)
        return cls(int(num_samples), int(num_tokens), mode == "token-mean", mode, args.rollout_max_response_len)

    def reduce(self, per_token_values: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> torch.Tensor:
        """This micro-batch's share of the step's aggregate of a loss term, under `mode`."""
        return LOSS_AGGREGATIONS.get(self.mode)(per_token_values, loss_masks, self.counts)

    def mean(self, per_token_values: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> torch.Tensor:
        """This micro-batch's share of the step's mean of a metric: token-mean under `token-mean`, else
        seq-mean-token-mean (a sum would turn fractions such as clipfrac into counts)."""
        mode = "token-mean" if self.mode == "token-mean" else "seq-mean-token-mean"
        return LOSS_AGGREGATIONS.get(mode)(per_token_values, loss_masks, self.counts)

    def token_share(self, loss_masks: list[torch.Tensor]) -> float:
        """Fraction of the step's trainable tokens in this micro-batch (weights token-mean metrics)."""
        return float(sum(mask.sum() for mask in loss_masks)) / max(self.num_tokens, 1)


def count_step_samples_and_tokens(step_sample_indices: list[list[int]], loss_masks: list[torch.Tensor]) -> torch.Tensor:
    """`[num_steps, 2]` float64: each step's sample count and trainable-token count on this rank.

    Sum it over the data-parallel ranks, then build each step's `StepNormalizer.from_args` from its row.
    """
    counts = torch.zeros(len(step_sample_indices), 2, dtype=torch.float64)
    for step, indices in enumerate(step_sample_indices):
        counts[step, 0] = len(indices)
        counts[step, 1] = sum(float(loss_masks[i].sum()) for i in indices)
    return counts
