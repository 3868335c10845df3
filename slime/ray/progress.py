"""Progress bars in the driver's terminal for the rollouts running inside the RolloutManager actor.

The rollout code reports to slime/utils/progress.py in the actor's process; `get_with_progress` polls
`RolloutManager.progress` (its own concurrency group, so it answers while `generate` runs) and draws one
tqdm bar per rollout and per eval set here, instead of the Ray-prefixed line per update the actor would print.
"""

from __future__ import annotations

import logging
from typing import Any, TextIO

import ray
from tqdm import tqdm

from slime.utils.progress import ProgressState

logger = logging.getLogger(__name__)

# A progress call answers in milliseconds even while a rollout runs; one this late means the actor is in trouble,
# which `ref` itself will report.
PROGRESS_TIMEOUT_S = 30.0


def _draw(bars: dict[str, tqdm], states: list[ProgressState], file: TextIO | None) -> None:
    for state in states:
        bar = bars.get(state.key)
        if bar is None:
            # `initial`: a bar first seen part-way (its rollout ran while the driver was busy) rates only what follows.
            bar = bars[state.key] = tqdm(
                desc=state.desc, total=state.total, unit=state.unit, initial=state.n, file=file, dynamic_ncols=True
            )
        elif (bar.n, bar.total) != (state.n, state.total):
            bar.total, bar.n = state.total, state.n
            bar.refresh()
        if state.done:
            bars.pop(state.key).close()


def get_with_progress(manager: Any, ref: ray.ObjectRef, poll_s: float = 0.5, file: TextIO | None = None) -> Any:
    """`ray.get(ref)`, drawing the manager's progress bars until `ref` is ready.

    Args:
        manager: The RolloutManager actor handle (its `progress` method returns `ProgressState`s).
        ref: A call on that manager, e.g. `manager.generate.remote(rollout_id, dp_size)`.
        poll_s: Seconds between polls of the manager's progress.
        file: Stream the bars are drawn to; tqdm's default (stderr) when None.

    Returns:
        What `ray.get(ref)` returns; its exception propagates unchanged. Bars still open when `ref` is ready (a
        background loop's) are closed where they stand; a later call draws them afresh.
    """
    bars: dict[str, tqdm] = {}
    polling, ready = True, False
    try:
        while True:
            if polling:
                try:
                    _draw(bars, ray.get(manager.progress.remote(), timeout=PROGRESS_TIMEOUT_S), file)
                except ray.exceptions.RayError as e:
                    # Bars are only a view: the manager's own failure reaches the caller through `ref`.
                    logger.warning("rollout progress unavailable, waiting without bars: %s", e)
                    polling = False
            if ready:
                break
            ready = bool(ray.wait([ref], timeout=poll_s)[0])
    finally:
        for bar in bars.values():
            bar.close()
    return ray.get(ref)
