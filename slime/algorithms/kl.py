"""KL estimators (`--kl-loss-type`): per-token estimates of KL(pi || pi_base) from tokens sampled from pi.

Each estimator is a function of `log_ratio = log pi - log pi_base` (float32, per token). Register your own:

    @register_kl_estimator("my_kl")
    def my_kl(log_ratio):
        return log_ratio.abs().sqrt()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slime.algorithms.registry import Registry, origin_of

# Log-weights are clamped to this range before exp() so that a wild log-ratio gives a large
# but finite weight (and finite gradients) instead of inf; every bound used in practice lies
# far inside [e^-20, e^20], so clamping never changes which tokens are clipped or masked.
LOG_WEIGHT_LIMIT = 20.0


@dataclass(frozen=True)
class KLEstimator:
    """A registered KL estimator: `fn(log_ratio) -> kl`, and the range its (weighted) value is clamped to."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    clamp: float | None = None


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "--kl-loss-type")


def register_kl_estimator(name: str, *, clamp: float | None = None) -> Callable:
    """Decorator registering `fn(log_ratio: Tensor) -> Tensor` as the `--kl-loss-type name` estimator.

    Args:
        name: The `--kl-loss-type` value.
        clamp: If set, the estimate (after any importance weighting) is clamped to `[-clamp, clamp]`.
    """

    def decorator(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        KL_ESTIMATORS.add(name, KLEstimator(fn, clamp), origin_of(fn))
        return fn

    return decorator


@register_kl_estimator("k1")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """`log_ratio`: unbiased, high variance, can be negative."""
    return log_ratio


@register_kl_estimator("k2")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """`log_ratio**2 / 2`: biased, low variance."""
    return log_ratio.pow(2) / 2


@register_kl_estimator("k3")
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """`exp(-log_ratio) - 1 + log_ratio`: Schulman's `r - 1 - log r` with `r = pi_base / pi`, unbiased and >= 0."""
    return torch.exp(-log_ratio) - 1 + log_ratio


@register_kl_estimator("low_var_kl", clamp=10.0)
def kl_low_var(log_ratio: torch.Tensor) -> torch.Tensor:
    """`k3`, clamped to `[-10, 10]` after any importance weighting."""
    # Beyond |log_ratio| = 20 the clamped value is 10 either way; clamping here keeps exp() finite,
    # so the backward pass yields zeros instead of 0 * inf = nan.
    return kl_k3(log_ratio.clamp(-LOG_WEIGHT_LIMIT, LOG_WEIGHT_LIMIT))


@register_kl_estimator("abs")
def kl_abs(log_ratio: torch.Tensor) -> torch.Tensor:
    """`|log_ratio|`: the k1 magnitude, never negative (verl's `abs`)."""
    return log_ratio.abs()


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_base) with the registered estimator `kl_loss_type`.

    Built-ins, with `log_ratio = log_probs - log_probs_base`: `"k1"` (log_ratio), `"k2"` (log_ratio²/2),
    `"k3"` (exp(-log_ratio) - 1 + log_ratio), `"low_var_kl"` (k3 clamped to [-10, 10]), `"abs"` (|log_ratio|).

    Args:
        log_probs (`torch.Tensor`):
            Log-probabilities of the sampled tokens under the current policy pi.
        log_probs_base (`torch.Tensor`):
            Log-probabilities of the same tokens under the base policy (usually the reference model).
        kl_loss_type (`str`):
            A registered estimator name.
        importance_ratio (`torch.Tensor`, *optional*):
            Per-token weight multiplied into the estimate before clamping, e.g. pi/pi_old when the
            tokens were sampled from an older policy (`--use-unbiased-kl`).

    Returns:
        `torch.Tensor`: Per-token KL estimate, float32, same shape as the inputs.
    """
    estimator = KL_ESTIMATORS.get(kl_loss_type)
    kl = estimator.fn(log_probs.float() - log_probs_base.float())
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if estimator.clamp is not None:
        kl = kl.clamp(-estimator.clamp, estimator.clamp)
    return kl
