"""Progress of the rollouts running in this process, for the driver to draw.

Rollout code reports (`start`, `advance`, `finish`) instead of drawing bars: it runs inside the
RolloutManager Ray actor, whose output reaches the user's terminal only as Ray-prefixed log lines.
The driver polls `snapshot()` through `RolloutManager.progress` and draws one bar per key
(slime/ray/progress.py). The registry is module state guarded by a lock: rollout code reports from the
actor's thread and the asyncio loop thread while `progress` reads it from another.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass


@dataclass
class ProgressState:
    """One bar: `n` of `total` `unit`s done; `done` once its work has ended (finished or failed)."""

    key: str
    desc: str
    n: int
    total: int | None
    unit: str
    done: bool = False


# Finished bars nobody has read yet are kept up to this many (the earliest finished dropped), so a driver that never
# polls does not make the registry grow with every rollout.
MAX_UNREAD_FINISHED = 64

_lock = threading.Lock()
_states: dict[str, ProgressState] = {}
# The keys of finished, unread bars in the order they finished (a long bar finishing now is the newest, though it
# started first).
_finished: dict[str, None] = {}


def start(key: str, desc: str, total: int | None, unit: str = "it") -> None:
    """Begin the bar `key` at 0 (replacing a bar of the same key); `total` None when unknown."""
    with _lock:
        _states.pop(key, None)  # re-inserted last, so snapshots list bars in the order they started
        _finished.pop(key, None)
        _states[key] = ProgressState(key=key, desc=desc, n=0, total=total, unit=unit)


def advance(key: str, n: int = 1) -> None:
    """Add `n` to the bar `key`; a key never started or already finished is ignored."""
    with _lock:
        state = _states.get(key)
        if state is not None and not state.done:
            state.n += n


def finish(key: str) -> None:
    """Mark the bar `key` done, where it stands (its work may have failed short of `total`)."""
    with _lock:
        state = _states.get(key)
        if state is None or state.done:
            return
        state.done = True
        _finished[key] = None
        while len(_finished) > MAX_UNREAD_FINISHED:
            earliest = next(iter(_finished))
            del _finished[earliest], _states[earliest]


def snapshot() -> list[ProgressState]:
    """Copies of every bar, in start order. A finished bar is in exactly one snapshot (the first taken after it
    finished) and is then forgotten, so the one reader, the driver, draws it to its end once."""
    with _lock:
        states = [dataclasses.replace(s) for s in _states.values()]
        for key in _finished:
            del _states[key]
        _finished.clear()
    return states
