"""Engine health monitoring for `--use-fault-tolerance`.

A background thread probes every engine's `/health_generate` (a one-token generation, so a server
that is up but stuck also fails) every `--rollout-health-check-interval` seconds, starting
`--rollout-health-check-first-wait` seconds after the engines came up. An engine whose probe fails
or does not answer within `--rollout-health-check-timeout` seconds is handed to `on_failure`, which
the RolloutManager uses to take it out of the router and restart it; it is not probed again until
`on_failure` returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from slime.backends.sglang_utils.http_client import EngineClient

logger = logging.getLogger(__name__)


class EngineHealthMonitor:
    """Probes engines in a daemon thread and reports each failed one once.

    Args:
        engine_clients: Called before each round; a client of every engine (index = engine rank).
        on_failure: `on_failure(index, reason, probe_started)`, called in the probing thread;
            `probe_started` (time.monotonic()) lets it ignore a probe that began before a restart ended.
        interval: Seconds between rounds.
        timeout: Seconds one probe may take.
        first_wait: Seconds before the first round.
        before_round: Called at the start of each round, in the probing thread (the router's check: engines are
            probed directly, a dead router would go unnoticed).
    """

    def __init__(
        self,
        engine_clients: Callable[[], list[EngineClient]],
        on_failure: Callable[[int, str, float], None],
        interval: float,
        timeout: float,
        first_wait: float = 0.0,
        before_round: Callable[[], None] = lambda: None,
    ):
        self.engine_clients = engine_clients
        self.on_failure = on_failure
        self.before_round = before_round
        self.interval = interval
        self.timeout = timeout
        self.first_wait = first_wait
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-health-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout + 5)

    def pause(self) -> None:
        """Stop probing (engines released for a colocated trainer answer 503 by design)."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def probe_now(self) -> None:
        """One round of probes in the caller's thread (failed engines go to `on_failure` before it returns)."""
        self._probe_all()

    def _run(self) -> None:
        if self._stop.wait(self.first_wait):
            return
        while not self._stop.is_set():
            started = time.monotonic()
            if not self._paused.is_set():
                self._probe_all()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def _probe_all(self) -> None:
        try:
            self.before_round()
        except Exception:
            logger.exception("the health monitor's router check failed")
        for index, client in enumerate(self.engine_clients()):
            if self._stop.is_set() or self._paused.is_set():
                return
            probe_started = time.monotonic()
            if client.health_generate(timeout=self.timeout) or self._paused.is_set():
                continue
            reason = f"no 200 from /health_generate within {self.timeout:g} s"
            logger.warning("engine %d at %s failed its health check: %s", index, client.base_url, reason)
            try:
                self.on_failure(index, reason, probe_started)
            except Exception:
                logger.exception("recovering engine %d at %s failed", index, client.base_url)
