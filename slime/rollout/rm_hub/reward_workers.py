"""Built-in rewards graded in worker processes, each answer under a hard timeout.

sympy (under math-verify) can run for minutes on answers like `(x+1)^{999}` against `(x+2)^{999}`, a regular
expression can backtrack for as long on a hostile response, and a signal-based timeout never fires on the
rollout's event-loop thread. So every built-in rule-based reward runs in separate processes: one still grading
after `--rm-timeout-secs` is killed, and a fresh one takes its place for the next answer. The caller scores such
an answer as wrong; `pop_reward_metrics` counts it.

A worker is a fresh `python` (the spawn model: none of the parent's Ray or torch state is inherited) that
speaks JSON lines over stdin/stdout, so nothing is unpickled on either side.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import SimpleQueue
from typing import Any

DEFAULT_TIMEOUT_SECS = 5.0
SYMBOLIC_TYPES = ("math", "deepscaler", "dapo")  # the rewards that may run sympy
WARMED = b'{"warmed": true}'
DEFAULT_NUM_WORKERS = 1
STARTUP_TIMEOUT_SECS = 120.0  # imports on a busy 2-core machine; not counted against any answer

_WORKER_COMMAND = "from slime.rollout.rm_hub.reward_workers import worker_main; worker_main()"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding `slime/`

_counts: Counter[str] = Counter()
_counts_lock = threading.Lock()


def _count(name: str) -> None:
    with _counts_lock:
        _counts[name] += 1


def add_reward_seconds(seconds: float) -> None:
    """Add one reward call's wall time to `pop_reward_metrics()["perf/reward_time"]`."""
    with _counts_lock:
        _counts["reward_seconds"] += seconds


def pop_reward_metrics() -> dict[str, float]:
    """Answers that could not be graded since the last call and the seconds spent grading; resets them.

    Returns:
        `{"reward/timeouts": n, "reward/worker_crashes": m, "perf/reward_time": s}`: answers whose worker was
        killed past the timeout, answers whose worker died while grading (both scored as wrong), and the wall
        time of all reward calls summed (they run concurrently, so it can exceed the rollout's time).
    """
    with _counts_lock:
        metrics = {f"reward/{name}": float(_counts[name]) for name in ("timeouts", "worker_crashes")}
        metrics["perf/reward_time"] = float(_counts["reward_seconds"])
        _counts.clear()
    return metrics


class GradingTimeout(TimeoutError):
    """The worker was still grading after the timeout; it was killed."""


class GradingCrash(RuntimeError):
    """The worker died while grading (e.g. out of memory, or a crash in a C extension)."""


class RewardWorkerError(RuntimeError):
    """The reward function raised inside the worker (the message carries its traceback), or no worker could start."""


class _Worker:
    """One grading process and the unread part of its output."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        # stderr is inherited, so a worker's own errors show up in the parent's log.
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._buffer = b""
        self.warmed = False  # whether it has built math-verify's parser (on its first symbolic answer)
        try:
            ready = self._read_line(STARTUP_TIMEOUT_SECS)
        except EOFError:
            ready = None
        if ready != b'{"ready": true}':
            self.kill()
            raise RewardWorkerError(
                f"reward worker process did not start (exit code {self.process.returncode}; its error, if any, is "
                f"in stderr above). It runs `{sys.executable} -c {_WORKER_COMMAND!r}`: slime and math-verify must "
                "be importable by that interpreter"
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def _read_line(self, timeout: float) -> bytes | None:
        """The next output line, or None when none arrived in time. EOFError when the process is gone."""
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        poller = select.poll()  # not select.select: a busy Ray actor can hold file descriptors above 1024
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            # poll() rounds its timeout up to a whole millisecond: what arrives past the deadline is late all the same.
            if remaining <= 0 or not poller.poll(remaining * 1000) or time.monotonic() > deadline:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _send(self, message: dict[str, Any]) -> None:
        self.process.stdin.write(json.dumps(message, default=str).encode() + b"\n")
        self.process.stdin.flush()

    def grade(self, task: dict[str, Any], timeout: float) -> Any:
        try:
            if task["rm_type"] in SYMBOLIC_TYPES and not self.warmed:
                # Building the symbolic parser is start-up, not this answer's time: asked for, and waited for, before
                # the answer is sent and its clock starts.
                self._send({"warm": True})
                if self._read_line(STARTUP_TIMEOUT_SECS) != WARMED:
                    self.kill()
                    raise RewardWorkerError(f"reward worker {self.pid} did not build math-verify's parser")
                self.warmed = True
            self._send(task)
            line = self._read_line(timeout)
        except (BrokenPipeError, EOFError) as error:
            self.kill()
            raise GradingCrash(f"reward worker {self.pid} died (exit code {self.process.returncode})") from error
        if line is None:
            self.kill()
            raise GradingTimeout(f"reward worker {self.pid} took longer than {timeout} s; killed")
        reply = json.loads(line)
        if "error" in reply:
            raise RewardWorkerError(f"{reply['error']}\n--- traceback in the reward worker ---\n{reply['traceback']}")
        return reply["reward"]

    def kill(self) -> None:
        # SIGKILL: it cannot be caught or ignored, whatever the grading code did with signals.
        if self.alive():
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class RewardWorkerPool:
    """`num_workers` grading processes, each started on first use and replaced after a timeout or crash.

    One thread per process waits on it, so the asyncio loop that awaits `grade` is never blocked.
    """

    def __init__(self, num_workers: int = DEFAULT_NUM_WORKERS):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"--rm-num-workers must be a whole number >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self._slots: SimpleQueue[_Worker | None] = SimpleQueue()
        for _ in range(num_workers):
            self._slots.put(None)
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="slime-reward")
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        with self._lock:
            return [worker.pid for worker in self._workers if worker.alive()]

    async def grade(self, rm_type: str, response: str, label: Any, timeout: float, metadata: dict | None = None) -> Any:
        """Reward of `response` by the rule-based reward `rm_type`, computed in a worker.

        Args:
            timeout: Seconds the worker may spend on this answer; waiting for a free worker does not count.

        Raises:
            GradingTimeout, GradingCrash: the answer could not be graded (counted in `pop_reward_metrics`).
            RewardWorkerError: the reward function raised in the worker, or no worker could be started.
        """
        if not timeout or timeout <= 0:
            raise ValueError(f"--rm-timeout-secs must be > 0, got {timeout!r}")
        task = {"rm_type": rm_type, "response": response, "label": label, "metadata": metadata or {}}
        return await asyncio.wrap_future(self._threads.submit(self._grade_blocking, task, timeout))

    def _grade_blocking(self, task: dict[str, Any], timeout: float) -> Any:
        worker = self._slots.get()  # never waits: there are as many slots as threads
        try:
            if self._closed:
                raise RuntimeError("the reward worker pool was shut down")
            if worker is None or not worker.alive():
                worker = self._start_worker()
            return worker.grade(task, timeout)
        except GradingTimeout:
            _count("timeouts")
            raise
        except GradingCrash:
            _count("worker_crashes")
            raise
        finally:
            self._slots.put(worker if worker is not None and worker.alive() else None)

    def start(self) -> None:
        """Start every worker now, in the background, rather than at the first answers (a worker's imports take
        seconds, which the first rollout would otherwise wait for)."""
        for _ in range(self.num_workers):
            self._threads.submit(self._start_idle_worker)

    def _start_idle_worker(self) -> None:
        worker = self._slots.get()
        try:
            if worker is None and not self._closed:
                worker = self._start_worker()
        except RewardWorkerError:
            pass  # the first answer starts one again and raises the error where it is awaited
        finally:
            self._slots.put(worker)

    def _start_worker(self) -> _Worker:
        worker = _Worker()
        with self._lock:
            self._workers = {w for w in self._workers if w.alive()} | {worker}
        return worker

    def close(self) -> None:
        """Kill every worker; a `grade` still waiting then fails."""
        self._closed = True
        with self._lock:
            workers, self._workers = self._workers, set()
        for worker in workers:
            worker.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)


_pool: RewardWorkerPool | None = None
_pool_lock = threading.Lock()


def get_reward_pool(num_workers: int = DEFAULT_NUM_WORKERS) -> RewardWorkerPool:
    """The process-wide pool (created on first use; recreated if `num_workers` changes)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.num_workers != num_workers:
            old, _pool = _pool, RewardWorkerPool(num_workers)
            if old is not None:
                old.close()
        return _pool


def shutdown_reward_workers() -> None:
    """Kill the process-wide pool's workers (also run at interpreter exit)."""
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
            _pool = None


atexit.register(shutdown_reward_workers)


def _exit_when_orphaned(parent_pid: int) -> None:
    # A parent killed with SIGKILL leaves us stuck in sympy with nobody reading: leave too.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def worker_main() -> None:
    """Body of a worker process: read tasks from stdin, write one JSON reply line per task."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the protocol
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()

    from slime.rollout.rm_hub import RULE_BASED_REWARDS, math_utils

    math_utils.SYMPY_TIMEOUT_SECONDS = None  # the parent's kill is the timeout here

    def reply(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message).encode() + b"\n")
        protocol.flush()

    reply({"ready": True})
    for line in sys.stdin.buffer:
        task = json.loads(line)
        if task.get("warm"):
            # The first symbolic check builds math-verify's LaTeX parser (about a second): the parent asks for it
            # before a worker's first symbolic answer. Workers that grade only other types never pay for it.
            math_utils.is_equiv("(x+1)^2", "x^2+2x+1")
            reply({"warmed": True})
            continue
        try:
            reward = RULE_BASED_REWARDS[task["rm_type"]](task["response"], task["label"], task.get("metadata") or {})
            reply({"reward": reward})
        except Exception as error:
            reply({"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()})
