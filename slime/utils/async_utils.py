"""One long-lived asyncio loop on a daemon thread, so sync code (Ray actors, train.py) can run
coroutines that share an aiohttp session across calls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def get_event_loop() -> asyncio.AbstractEventLoop:
    """The shared background loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="slime-async", daemon=True).start()
    return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the shared loop and block until it finishes; exceptions propagate."""
    return asyncio.run_coroutine_threadsafe(coro, get_event_loop()).result()
