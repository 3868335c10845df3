"""Upstream's `slime.observability.logging_utils` for plugins: `log` adds metrics to the row of the rollout being
logged, as in upstream's custom rollout log functions:

    def log_rollout(rollout_id, args, samples, extra_metrics, rollout_time):  # --custom-rollout-log-function-path
        metrics = {"my/score": ..., "rollout/step": compute_rollout_step(args, rollout_id)}
        logging_utils.log(args, metrics, step_key="rollout/step")
        return True  # True: skip slime's default rollout figures

Where upstream writes to wandb / TensorBoard from any process, slime keeps one tracker in the driver: the metrics
logged here wait in this process until the rollout manager takes them (`pop_logged_metrics`) into the rollout's
row, which goes to every enabled sink and `--save`/metrics.jsonl. So `log` reaches the row from code that runs in
the rollout manager (generate, reward, filter and rollout-log functions), not from a trainer rank.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from slime.utils.tracking import configure_logging

_lock = threading.Lock()
_pending: dict[str, Any] = {}


def configure_logger(prefix: str = "") -> None:
    """Log INFO and above to stderr in slime's format (upstream's `prefix` tag is not used)."""
    configure_logging(logging.INFO)


def log(args, metrics: dict[str, Any], step_key: str | None = None) -> None:
    """Add `metrics` to the row of the rollout being logged (later values of a key win).

    Args:
        args: The run's arguments (upstream's signature; slime's tracker knows the sinks).
        metrics: Metric name to value.
        step_key: The entry of `metrics` that holds the step; dropped, the row's step is the rollout's.
    """
    with _lock:
        _pending.update({key: value for key, value in metrics.items() if key != step_key})


def pop_logged_metrics() -> dict[str, Any]:
    """The metrics `log` gathered in this process since the last call, which then starts afresh."""
    with _lock:
        metrics = dict(_pending)
        _pending.clear()
    return metrics
