"""The engine pool's restart bookkeeping under --use-fault-tolerance: one death is one restart, whoever reports it."""

from __future__ import annotations

import time

from support.flags import slime_flags

from slime.ray.engine_pool import EnginePool


class RestartedDuringTheProbe(EnginePool):
    """A pool whose health probe finds engine 0 dead while the health monitor finishes restarting it (the monitor
    records a restart as `_recover` does), as happens when the probe waits on a slow engine under load."""

    def dead_engines(self, released: bool = False) -> list[int]:
        with self._recovery_changed:
            self._restarted_at[0] = time.monotonic()
            self._awaiting_weights.add(0)
            self.num_restarts += 1
        return [0]


def test_an_engine_the_monitor_restarted_during_a_steps_probe_is_not_restarted_again():
    pool = RestartedDuringTheProbe(slime_flags(use_fault_tolerance=True), None)
    pool.monitor = object()  # fault tolerance on; nothing here probes on its own
    pool.engine_urls = ["http://127.0.0.1:9"]
    # A second restart would start here: it needs a router and an engine actor, and this pool has neither.
    assert pool.replace_dead_engines("updating the engines' weights") == [0]
    assert pool.num_restarts == 1
