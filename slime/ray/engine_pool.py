"""EnginePool: the router and the inference engines behind it, from start to dispose.

It starts the router and the engines (RolloutEngine actors, or clients of `--rollout-external-engine-addrs`),
tells dead engines, restarts failed ones under `--use-fault-tolerance` and puts them back into the router once
they hold the current weights, releases and resumes their memory for a colocated trainer, and stops everything
it started. The RolloutManager owns one and delegates its engine work to it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import ray

from slime.backends.sglang_utils.engine_actor import RolloutEngine
from slime.backends.sglang_utils.engine_command_line import engine_api_key
from slime.backends.sglang_utils.http_client import EngineClient
from slime.backends.sglang_utils.router import (
    RouterHandle,
    add_worker,
    remove_worker,
    router_is_healthy,
    start_router,
    wait_for_workers,
)
from slime.ray.engine_health import EngineHealthMonitor
from slime.ray.placement_group import PlacementSlice
from slime.utils.http_utils import wait_until_healthy

logger = logging.getLogger(__name__)


class EnginePool:
    """Router and engines of one rollout manager.

    Args:
        args: Parsed arguments (engine, router and fault-tolerance flags).
        rollout_slice: The devices of the engines; None without engines (`--debug-train-only`).
        on_engine_restarted: Called (on the monitor's thread) after a restarted engine got its new URL.
    """

    def __init__(
        self, args, rollout_slice: PlacementSlice | None, on_engine_restarted: Callable[[], None] = lambda: None
    ):
        self.args = args
        self.rollout_slice = rollout_slice
        self.on_engine_restarted = on_engine_restarted
        self.router: RouterHandle | None = None
        self.engines: list = []
        self.engine_urls: list[str] = []
        # --use-fault-tolerance: engines being restarted, restarted ones not yet given the current weights.
        self.monitor: EngineHealthMonitor | None = None
        self.num_restarts = 0
        self._recovering: set[int] = set()
        self._awaiting_weights: set[int] = set()
        self._restarted_at: dict[int, float] = {}
        self._recovery_changed = threading.Condition()
        self._router_lock = threading.Lock()
        self.num_router_restarts = 0
        self._started: concurrent.futures.Future | None = None

    # ---- start ---------------------------------------------------------------------------
    def start_in_background(self) -> None:
        """Bring router and engines up on a thread (the driver builds the trainers meanwhile: the two are most of a
        run's start-up); `wait` blocks until they are up."""
        starter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="start-engines")
        self._started = starter.submit(self._start)
        starter.shutdown(wait=False)

    def wait(self) -> None:
        """Block until router and engines are up; re-raises the error that stopped them from starting."""
        if self._started is not None:
            self._started.result()

    def router_address(self) -> tuple[str | None, int | None]:
        """(host, port) of the router, (None, None) without one."""
        if self.router is None:
            return None, None
        address = urlparse(self.router.url)
        return address.hostname, address.port

    def _start(self) -> None:
        args = self.args
        external = args.rollout_external_engine_addrs
        try:
            # Engines the user started are only routed to and given weights, through plain clients.
            if external:
                self.engines = [self._client(url) for url in external]
            else:
                # The engines' processes (seconds of imports and a model load) start before the router (under one).
                num_engines = max(1, len(self.rollout_slice) // args.rollout_num_gpus_per_engine)
                self.engines = [self._create_engine(rank) for rank in range(num_engines)]
                started = [engine.start.remote(timeout=args.rollout_engine_start_timeout) for engine in self.engines]
            self.router = start_router(args)
            if external:
                self.engine_urls = wait_for_external_engines(external, args.rollout_engine_start_timeout)
            else:
                self.engine_urls = ray.get(started)
            for url in self.engine_urls:
                add_worker(self.router.url, url, api_key=engine_api_key(args))
            wait_for_workers(self.router.url, self.engine_urls, timeout=args.rollout_engine_start_timeout)
        except Exception:
            self.dispose()
            raise
        logger.info("router %s with engines %s", self.router.url, self.engine_urls)
        if args.use_fault_tolerance:
            self.monitor = EngineHealthMonitor(
                lambda: [self._client(url) for url in self.engine_urls],
                self._recover,
                interval=args.rollout_health_check_interval,
                timeout=args.rollout_health_check_timeout,
                first_wait=args.rollout_health_check_first_wait,
                before_round=self.restart_router_if_dead,
            )
            self.monitor.start()

    def _create_engine(self, rank: int):
        """A RolloutEngine actor for engine `rank`, pinned to that engine's first bundle."""
        args, rollout_slice = self.args, self.rollout_slice
        per_engine = args.rollout_num_gpus_per_engine
        # Colocated engines share each bundle with a trainer rank, so each takes a fraction of it.
        share = 0.2 if args.colocate else 1.0
        options: dict[str, Any] = {"num_cpus": share}
        # 127.0.0.1, or its node's IP on a multi-node cluster: the router and the trainer reach it there.
        kwargs: dict[str, Any] = {"backend": args.rollout_backend, "host": rollout_slice.host(rank * per_engine)}
        if rollout_slice.use_gpu:
            options |= {
                "num_gpus": share,
                "runtime_env": {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            }
            kwargs["base_gpu_id"] = rollout_slice.gpu_ids[rank * per_engine]
        if rollout_slice.pg is not None:
            options["scheduling_strategy"] = rollout_slice.strategy(rank * per_engine)
        return ray.remote(RolloutEngine).options(**options).remote(args, rank, **kwargs)

    def _client(self, url: str) -> EngineClient:
        return EngineClient(url, api_key=engine_api_key(self.args))

    # ---- health --------------------------------------------------------------------------
    def dead_engines(self, released: bool = False) -> list[int]:
        """Indices of engines whose server process has exited or no longer answers GET /health.

        `released`: the engines' memory is released (colocated, between offload and onload), when an engine answers
        /health with 503 by design: only a connection that fails counts then.
        """
        dead = []
        for index, engine in enumerate(self.engines):
            try:
                # An external engine has no process here to watch: its /health below is all there is.
                alive = bool(self.args.rollout_external_engine_addrs) or ray.get(engine.is_alive.remote(), timeout=30)
            except Exception:  # the actor itself is gone
                alive = False
            # The process check alone can lag a SIGKILL (or watch a launcher whose server child died); an
            # engine that cannot answer /health would fail the next weight push, so it counts as dead too.
            client = self._client(self.engine_urls[index])
            if not alive or not (client.answers(timeout=10) if released else client.health(timeout=10)):
                dead.append(index)
        return dead

    def replace_dead_engines(self, what: str, released: bool = False) -> list[int]:
        """After `what` failed: which engines died? With `--use-fault-tolerance` restart them now (on this thread) and
        return the indices of every engine awaiting the current weights; without, raise naming them.

        Returns [] when no engine died or awaits weights: the failure was something else, for the caller to re-raise.

        Raises:
            RuntimeError: Without `--use-fault-tolerance`, an engine died (one line: the engines, their URLs, the
                flag); or the router died.
        """
        if self.router is not None and not router_is_healthy(self.router):
            if self.monitor is None:
                raise RuntimeError(self._router_death(what))
            self.restart_router_if_dead()
        # The health monitor may restart an engine while this probe runs; `_recover` ignores a verdict older than that.
        probe_started = time.monotonic()
        dead = self.dead_engines(released=released)
        if not dead:
            # The health monitor may have restarted the engine that failed the step already.
            return self.engines_awaiting_weights() if self.monitor is not None else []
        if self.monitor is None:
            raise RuntimeError(self._engine_death(what, dead))
        logger.warning("%s: inference engines %s died; restarting", what, dead)
        for index in dead:
            self._recover(index, f"dead during {what}", probe_started)
        return self.engines_awaiting_weights()

    def serving_problem(self, rollout_id: int) -> str | None:
        """What stops the engines from serving: a dead router or dead engines (None when all is well)."""
        if self.router is not None and not router_is_healthy(self.router):
            return self._router_death(f"rollout {rollout_id}")
        dead = self.dead_engines() if self.engines else []
        return self._engine_death(f"rollout {rollout_id}", dead) if dead else None

    def _router_death(self, what: str) -> str:
        fix = "it could not be restarted" if self.monitor is not None else "pass --use-fault-tolerance to restart it"
        return f"{what}: {self.router.describe_failure()}; {fix}, or resume from the last checkpoint with --load"

    def _engine_death(self, what: str, dead: list[int]) -> str:
        names = ", ".join(f"engine {i} ({self.engine_urls[i]})" for i in dead)
        fix = (
            "they could not be restarted in time"
            if self.monitor is not None
            else "pass --use-fault-tolerance to restart dead engines and go on"
        )
        return (
            f"{what}: inference {names} died; {fix}. Check the engine logs (in $TMPDIR/slime_logs) and resume from "
            "the last checkpoint with --load"
        )

    def check_after_rollout(self, rollout_id: int) -> None:
        """After a rollout that succeeded: with fault tolerance, find and restart engines that died meanwhile;
        without, fail on any death.

        Raises:
            RuntimeError: Without `--use-fault-tolerance`, the router or an engine died.
        """
        if self.monitor is not None:
            # An engine may have died after the monitor's last round (the rollout finished on the others):
            # probe now, then let restarts finish, so offloading and the next weight push see every engine.
            self.monitor.probe_now()
            self.engines_awaiting_weights()
            return
        # The router may have retried a dead engine's requests elsewhere; the run still cannot go on without it
        # (weight updates would miss it), so a death is an error even when the rollout itself succeeded.
        problem = self.serving_problem(rollout_id)
        if problem:
            raise RuntimeError(problem)

    def metrics(self) -> dict[str, float]:
        """`rollout/engine_restarts` (with fault tolerance) and the engines' `perf/engine_peak_memory_gb`."""
        metrics: dict[str, float] = {}
        if self.monitor is not None:
            metrics["rollout/engine_restarts"] = self.num_restarts
            metrics["rollout/router_restarts"] = self.num_router_restarts
        if self.engines and not self.args.rollout_external_engine_addrs:  # not measurable from here for external ones
            metrics["perf/engine_peak_memory_gb"] = max(ray.get([e.peak_memory_gb.remote() for e in self.engines]))
        return metrics

    # ---- fault tolerance -----------------------------------------------------------------
    def _recover(self, index: int, reason: str, probe_started: float) -> None:
        """Take a failed engine out of the router and restart it on its own bundle (the monitor's thread, or the step
        that found it dead); `probe_started` (time.monotonic()) is when the probe that found it failed began.

        The restarted engine still serves the checkpoint's weights, so it only goes back into the
        router in `readmit`, after the trainer has pushed the current weights to it.
        """
        with self._recovery_changed:
            # The monitor thread, probe_now and a failed step may all report one failure; a probe older than the
            # last restart of this engine says nothing about the restarted one.
            if index in self._recovering or probe_started < self._restarted_at.get(index, float("-inf")):
                return
            self._recovering.add(index)
        url = self.engine_urls[index]
        try:
            logger.warning("engine %d (%s) failed (%s): restarting it", index, url, reason)
            with contextlib.suppress(ValueError):  # not registered (yet): nothing to remove
                remove_worker(self.router.url, url)
            engine = self.engines[index]
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception:  # the actor itself is gone or stuck: replace it on the same bundle
                ray.kill(engine, no_restart=True)
                engine = self._create_engine(index)
            new_url = ray.get(engine.start.remote(timeout=self.args.rollout_engine_start_timeout))
            self.engines[index], self.engine_urls[index] = engine, new_url
            self.on_engine_restarted()
            with self._recovery_changed:
                self._awaiting_weights.add(index)
                self.num_restarts += 1
                self._restarted_at[index] = time.monotonic()
            logger.warning(
                "engine %d restarted at %s; it rejoins the router after the next weight push", index, new_url
            )
        finally:
            with self._recovery_changed:
                self._recovering.discard(index)
                self._recovery_changed.notify_all()

    def restart_router_if_dead(self) -> None:
        """`--use-fault-tolerance`: a router slime launched that died is launched again on its address, and the
        engines that serve (not those awaiting weights) are registered with it again, with their API key. Requests
        in flight meanwhile are retried by the rollouts (`engine_failover_window`)."""
        router = self.router
        if router is None or router.process is None or router_is_healthy(router):
            return
        with self._router_lock:
            if self.router is not router:  # restarted by another thread meanwhile
                return
            logger.warning("%s: restarting it", router.describe_failure())
            address = urlparse(router.url)
            on_its_address = argparse.Namespace(
                **{**vars(self.args), "sglang_router_ip": address.hostname, "sglang_router_port": address.port}
            )
            self.router = start_router(on_its_address)
            self.num_router_restarts += 1  # counted once it serves: requests may get through before the re-adds end
            with self._recovery_changed:
                serving = [url for i, url in enumerate(self.engine_urls) if i not in self._awaiting_weights]
            for url in serving:
                add_worker(self.router.url, url, api_key=engine_api_key(self.args))
            wait_for_workers(self.router.url, serving, timeout=self.args.rollout_engine_start_timeout)
            logger.warning("router restarted at %s with engines %s", self.router.url, serving)

    def engines_awaiting_weights(self, timeout: float | None = None) -> list[int]:
        """Indices of restarted engines that need the current weights, once running restarts are done.

        Raises:
            TimeoutError: A restart is still running after `timeout` seconds.
        """
        timeout = self.args.rollout_engine_start_timeout + 120 if timeout is None else timeout
        with self._recovery_changed:
            if not self._recovery_changed.wait_for(lambda: not self._recovering, timeout=timeout):
                raise TimeoutError(f"engines {sorted(self._recovering)} are still restarting after {timeout:.0f} s")
            return sorted(self._awaiting_weights)

    def readmit(self, indices: list[int]) -> None:
        """Put restarted engines, which now hold the current weights, back into the router."""
        urls = [self.engine_urls[i] for i in indices]
        for url in urls:
            add_worker(self.router.url, url, api_key=engine_api_key(self.args))
        wait_for_workers(self.router.url, urls, timeout=self.args.rollout_engine_start_timeout)
        with self._recovery_changed:
            self._awaiting_weights -= set(indices)
        logger.info("engines %s are back in the router", urls)

    # ---- memory and shutdown -------------------------------------------------------------
    def offload(self) -> dict[str, float]:
        """Release the engines' memory for a colocated trainer; returns `perf/engine_weight_memory_offloaded_gb`
        (what the engines report holding afterwards, summed) where they report it.

        An engine that dies meanwhile is restarted (`--use-fault-tolerance`) and released like the others, or named
        in the error."""
        if self.monitor is not None:
            self.monitor.pause()  # released engines answer health checks with 503 by design
        self._on_every_engine("release_memory_occupation", "offloading the engines", released=True)
        return self._weight_memory("perf/engine_weight_memory_offloaded_gb")

    def onload(self) -> dict[str, float]:
        """Give the engines their memory back; returns `perf/engine_weight_memory_onloaded_gb` likewise (an engine
        restarted meanwhile starts with its memory)."""
        self._on_every_engine("resume_memory_occupation", "onloading the engines", released=True, on_restarted=False)
        if self.monitor is not None:
            self.monitor.resume()
        return self._weight_memory("perf/engine_weight_memory_onloaded_gb")

    def _on_every_engine(self, method: str, what: str, released: bool, on_restarted: bool = True) -> None:
        """Call `method` on every engine; engines that die meanwhile are replaced (see `replace_dead_engines`) and,
        with `on_restarted`, the call made on the replacements too."""
        refs = [getattr(engine, method).remote() for engine in self.engines]
        failed = []
        for index, ref in enumerate(refs):
            try:
                ray.get(ref)
            except Exception as error:
                failed.append((index, error))
        if not failed:
            return
        restarted = self.replace_dead_engines(what, released=released)
        if not restarted:
            raise failed[0][1]
        if on_restarted:
            ray.get([getattr(self.engines[index], method).remote() for index in restarted])

    def _weight_memory(self, key: str) -> dict[str, float]:
        reported = ray.get([engine.weight_memory_gb.remote() for engine in self.engines])
        return {key: sum(reported)} if reported and None not in reported else {}

    def dispose(self) -> None:
        """Stop the monitor, the engines slime started and the router; leaves no process behind."""
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        if self.engines and not self.args.rollout_external_engine_addrs:  # never stop engines the user started
            ray.get([engine.shutdown.remote() for engine in self.engines])
            for engine in self.engines:
                ray.kill(engine)
        self.engines = []
        if self.router is not None:
            self.router.stop()
            self.router = None


def wait_for_external_engines(urls: list[str], timeout: float) -> list[str]:
    """Wait until every engine of `--rollout-external-engine-addrs` answers GET /health; returns `urls`.

    Raises:
        TimeoutError: naming the engine that did not answer and the flags to check.
    """
    for url in urls:
        try:
            wait_until_healthy(f"{url}/health", timeout)
        except TimeoutError as e:
            raise TimeoutError(
                f"--rollout-external-engine-addrs: engine {url} did not answer GET /health within "
                f"--rollout-engine-start-timeout {timeout:g} s; start it first, or fix the address ({e})"
            ) from None
    return list(urls)
