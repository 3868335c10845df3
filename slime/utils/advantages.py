"""Moved to `slime.algorithms.advantages`; this path keeps working for code that imports it."""

from slime.algorithms.advantages import compute_advantages_and_returns, reward_kl

__all__ = ["compute_advantages_and_returns", "reward_kl"]
