"""Serve an aiohttp application from a daemon thread with its own event loop (upstream's
`slime.agent.aiohttp_threaded`).

A rollout function runs in the rollout's event loop, which may block for seconds (tokenizing, a reward model); an
agent server that must keep answering its CLI agents meanwhile gets a loop of its own:

    adapter = AnthropicAdapter(tokenizer=tokenizer, sglang_url=router_url)
    handle = run_app_in_thread(adapter.app, host="127.0.0.1", port=0)
    ...  # agents call handle.url
    handle.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

logger = logging.getLogger(__name__)

# Readiness probes and model listings: polled constantly, never worth a log line.
_QUIET_PATHS = ("/healthz", "/health", "/v1/models")


class FilteredAccessLogger(AbstractAccessLogger):
    """aiohttp access logger (`runner_kwargs={"access_log_class": FilteredAccessLogger}`) that logs each request at
    INFO, except successful readiness probes and model listings."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if response.status < 400 and request.path.endswith(_QUIET_PATHS):
            return
        self.logger.info("%s %s -> %d in %.3f s", request.method, request.path, response.status, time)


@dataclass
class AppHandle:
    """A running app: where it listens, its loop and thread; `stop()` shuts it down."""

    host: str
    port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    runner: web.AppRunner

    @property
    def url(self) -> str:
        """Base URL of the app (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Run the app's cleanup (open requests are cancelled), stop its loop and join the thread."""
        if not self.loop.is_running():
            return
        cleanup = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        try:
            cleanup.result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)


def run_app_in_thread(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    thread_name: str = "aiohttp-app",
    runner_kwargs: dict[str, Any] | None = None,
    ready_timeout: float = 30.0,
) -> AppHandle:
    """Start serving `app` on `host:port` from a new daemon thread and return once it accepts connections.

    Args:
        port: 0 lets the kernel pick a free port (read it from `handle.port`).
        runner_kwargs: Passed to `web.AppRunner` (e.g. `handler_cancellation=True`, `access_log_class`).

    Raises:
        OSError: The address cannot be bound (e.g. the port is taken); the message names it.
    """
    started: concurrent.futures.Future = concurrent.futures.Future()
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        runner = web.AppRunner(app, **(runner_kwargs or {}))
        await runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            sock.close()
            await runner.cleanup()
            raise OSError(error.errno, f"cannot serve {host}:{port}: {error.strerror}") from None
        await web.SockSite(runner, sock).start()
        started.set_result((runner, sock.getsockname()[1]))

    def main() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
        except BaseException as error:  # reported to the caller, which is waiting on `started`
            started.set_exception(error)
            loop.close()
            return
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=main, name=thread_name, daemon=True)
    thread.start()
    runner, bound_port = started.result(ready_timeout)
    logger.info("%s serving on %s:%d", thread_name, host, bound_port)
    return AppHandle(host, bound_port, loop, thread, runner)
