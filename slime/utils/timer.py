"""Named wall-clock timers that add up over a rollout step, under upstream slime's names.

    with Timer().context("reward"):          # or: with timer("reward"):
        ...
    @timer                                   # times every call under the function's name
    def train_step(...): ...
    Timer().log_dict()                       # {"reward": 1.2, "train_step": 30.5} seconds, summed
    Timer().reset()                          # start the next step from zero

`Timer()` is one object per process (`SingletonMeta`), so code far apart adds to the same totals.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from slime.utils.misc import SingletonMeta

__all__ = ["Timer", "inverse_timer", "timer"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class Timer(metaclass=SingletonMeta):
    """Seconds spent per name, summed until `reset`; a name runs at most once at a time."""

    def __init__(self):
        self.timers: dict[str, float] = {}
        self.start_time: dict[str, float] = {}

    def start(self, name: str) -> None:
        if name in self.start_time:
            raise RuntimeError(f"timer {name!r} is already running; end it before starting it again")
        self.start_time[name] = time.perf_counter()
        logger.debug("timer %s start", name)

    def end(self, name: str) -> float:
        """Stop `name`, add the elapsed seconds to its total and return them."""
        if name not in self.start_time:
            raise RuntimeError(f"timer {name!r} was not started; call start({name!r}) first")
        elapsed = time.perf_counter() - self.start_time.pop(name)
        self.add(name, elapsed)
        logger.debug("timer %s end (%.1fs)", name, elapsed)
        return elapsed

    def add(self, name: str, elapsed: float) -> None:
        """Add `elapsed` seconds to `name`'s total (for time measured elsewhere)."""
        self.timers[name] = self.timers.get(name, 0.0) + elapsed

    def reset(self, name: str | None = None) -> None:
        """Forget the totals of every name, or of `name` only; running timers keep running."""
        if name is None:
            self.timers = {}
        else:
            self.timers.pop(name, None)

    def log_dict(self) -> dict[str, float]:
        """The totals in seconds, by name (the live dict: copy it before `reset` if you keep it)."""
        return self.timers

    @contextmanager
    def context(self, name: str) -> Iterator[None]:
        """Time the `with` block under `name`, also when it raises."""
        self.start(name)
        try:
            yield
        finally:
            self.end(name)


def timer(name_or_func: str | F) -> Any:
    """`with timer("name"):` times a block; `@timer` times every call of a function under its `__name__`."""
    if isinstance(name_or_func, str):
        return Timer().context(name_or_func)
    func = name_or_func

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with Timer().context(func.__name__):
            return func(*args, **kwargs)

    return wrapper


@contextmanager
def inverse_timer(name: str) -> Iterator[None]:
    """Pause the running timer `name` for the `with` block (leave out time spent waiting on something else)."""
    Timer().end(name)
    try:
        yield
    finally:
        Timer().start(name)
