"""Upstream's `slime.observability.timer`: slime's named timers (`slime.utils.timer`)."""

from slime.utils.timer import Timer, inverse_timer, timer

__all__ = ["Timer", "inverse_timer", "timer"]
