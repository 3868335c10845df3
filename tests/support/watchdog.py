"""The suite's watchdog: a test still running past its timeout (plus a grace) is interrupted, whatever it waits on.

pytest-timeout fails a test by raising from a SIGALRM handler, which two things defeat. It stops its clock once a
test has failed, so a teardown that then hangs runs on; and `ray.get` swallows every exception its signal check
sees except KeyboardInterrupt, so a test blocked on an actor that never answers is never failed (one did, for the
whole CI budget). Past a test's timeout plus `INTERRUPT_GRACE_SECONDS`, the watchdog prints every thread's stack
and sends its own process SIGINT, again every `REPEAT_SECONDS` while the test is still running: the
KeyboardInterrupt ends the wait (Ray's too) and the phase it lands in fails, naming the test, instead of ending
the session. A process that still has not moved on after `KILL_SECONDS` exits; pytest-xdist reports the crash.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

import pytest

INTERRUPT_GRACE_SECONDS = 60
REPEAT_SECONDS = 30
KILL_SECONDS = 300


class Watchdog:
    """Interrupts this process if `stop` is not called within `seconds`."""

    def __init__(self, nodeid: str, seconds: float):
        self.nodeid, self.seconds = nodeid, seconds
        self.fired = False
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="suite-watchdog", daemon=True).start()

    def _watch(self) -> None:
        if self._stopped.wait(self.seconds):
            return
        self.fired = True
        sys.stderr.write(f"\n{self.nodeid}: still running {self.seconds:.0f} s after it started; interrupting it\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for _ in range(KILL_SECONDS // REPEAT_SECONDS):
            os.kill(os.getpid(), signal.SIGINT)
            if self._stopped.wait(REPEAT_SECONDS):
                return
        sys.stderr.write(f"\n{self.nodeid}: did not stop when interrupted; this test process exits\n")
        sys.stderr.flush()
        os._exit(70)

    def stop(self) -> None:
        self._stopped.set()


_WATCHDOG = pytest.StashKey[Watchdog]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    marker = item.get_closest_marker("timeout")
    if marker is None or not marker.args:  # tests/conftest.py gives every test one
        return (yield)
    item.stash[_WATCHDOG] = watchdog = Watchdog(item.nodeid, marker.args[0] + INTERRUPT_GRACE_SECONDS)
    try:
        return (yield)
    finally:
        watchdog.stop()


def _fail_if_interrupted_by_the_watchdog(item):
    try:
        return (yield)
    except KeyboardInterrupt:
        watchdog = item.stash.get(_WATCHDOG, None)
        if watchdog is None or not watchdog.fired:
            raise  # the user's Ctrl-C: end the session as usual
        pytest.fail(f"interrupted by the suite's watchdog {watchdog.seconds:.0f} s after the test started")


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_fail_if_interrupted_by_the_watchdog)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_fail_if_interrupted_by_the_watchdog)
pytest_runtest_teardown = pytest.hookimpl(wrapper=True)(_fail_if_interrupted_by_the_watchdog)
