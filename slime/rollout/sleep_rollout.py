"""Upstream slime's idle rollout function: it never returns, so the run stops at its first rollout with the engines
and the router up, for sending them requests by hand or attaching a debugger.

    --rollout-function-path slime.rollout.sleep_rollout.sleep
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

SLEEP_INTERVAL_SECONDS = 3600.0  # one log line per interval shows the process is alive


def sleep(args, rollout_id: int, data_source, evaluation: bool = False) -> None:
    """Block forever, logging once every `SLEEP_INTERVAL_SECONDS`; end it by stopping the job."""
    intervals = 0
    while True:
        time.sleep(SLEEP_INTERVAL_SECONDS)
        intervals += 1
        logger.info("rollout %d sleeps on purpose: %.0f s so far", rollout_id, intervals * SLEEP_INTERVAL_SECONDS)
