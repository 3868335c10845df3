"""HTTP plumbing shared by the router, the engines and the rollout: ports, health waits, JSON requests.

Port choice. `find_free_port` picks a random starting port in [10000, 32768) and probes upward until a
bind succeeds. The range sits below Linux's ephemeral range (32768-60999), so the kernel never hands
a chosen port to an outgoing connection before our server binds it. The random start makes two
processes that look for ports at the same moment (engine actors on one node) very unlikely to pick
the same one, and a per-process reserved set guarantees one process never hands out a port twice.
A port is only free at the moment we probe it; whoever binds it must still fail loudly if it is taken.

Requests. The sync helpers use urllib (no extra dependency) and are for control calls; the async
helper shares one aiohttp session per event loop so thousands of concurrent /generate calls reuse
connections. Both retry only when the connection itself failed (the request never reached a server,
or the server went away mid-request) and raise `HTTPRequestError` with the status and body otherwise.
Neither goes through an http_proxy from the environment (aiohttp ignores it by default, urllib is told
to), since engines and routers are internal addresses.

Upstream slime's helpers that plugins call keep upstream's names and signatures: `post`, `get` and
`init_http_client` on the shared session, `find_available_port` on the port finder, `get_host_info`,
`run_router` (sglang-router in the calling process, on 127.0.0.1 unless told otherwise) and `terminate_process`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import random
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    import aiohttp  # imported where the async helpers run: most processes (engine actors, trainers) never do

logger = logging.getLogger(__name__)

PORT_RANGE = (10000, 32768)
LOOPBACK = "127.0.0.1"

# OS entropy, not the global `random`: training code seeds that identically in every process, which would
# send concurrent engines probing from the same port.
_port_rng = random.SystemRandom()
_reserved_ports: set[int] = set()
_reserved_lock = threading.Lock()

# Engines and routers are internal addresses: never send their traffic through an http_proxy from the env.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# Statuses that mean "nobody handled this request": the router has no healthy worker, or a proxy hop failed.
RETRYABLE_STATUSES = {502, 503}


class HTTPRequestError(RuntimeError):
    """An HTTP request reached a server and got an error status back.

    Attributes:
        method: HTTP method, e.g. "POST".
        url: Full URL that was requested.
        status: HTTP status code.
        body: Response body as text (truncated to 2000 characters).
    """

    def __init__(self, method: str, url: str, status: int, body: str):
        self.method = method
        self.url = url
        self.status = status
        self.body = body[:2000]
        super().__init__(f"{method} {url} returned HTTP {status}: {self.body}")


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The `Authorization` header an engine started with `--api-key` requires (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def find_free_port(
    host: str = "127.0.0.1",
    exclude: set[int] | frozenset[int] = frozenset(),
    port_range: tuple[int, int] = PORT_RANGE,
) -> int:
    """Return a port on `host` that nothing is bound to right now and this process has not handed out before.

    Args:
        host: Interface to probe, e.g. "127.0.0.1" or "0.0.0.0" (every interface).
        exclude: Ports the caller already plans to use and must not get back.
        port_range: `[low, high)` to pick from; the default sits below the kernel's ephemeral range (module doc).

    Returns:
        A port number in `port_range`, recorded as reserved for the rest of this process.
    """
    low, high = port_range
    span = high - low
    start = _port_rng.randrange(span)
    with _reserved_lock:
        for offset in range(span):
            port = low + (start + offset) % span
            if port in _reserved_ports or port in exclude:
                continue
            if _can_bind(host, port):
                _reserved_ports.add(port)
                return port
    raise RuntimeError(f"no free port on {host} in [{low}, {high}); too many servers running on this machine?")


def find_available_port(base_port: int) -> int:
    """Upstream's port finder: a port in `[base_port, base_port + 1000)` free on every interface.

    It is `find_free_port` over that range, so it never hands out the same port twice in one process.

    Raises:
        ValueError: `base_port` is not a port number.
    """
    if not 0 < base_port < 65536:
        raise ValueError(f"base_port {base_port} is not a port number; pass one in [1, 65535]")
    return find_free_port("0.0.0.0", port_range=(base_port, min(base_port + 1000, 65536)))


def get_host_info() -> tuple[str, str]:
    """Upstream's `(hostname, IP address)` of this machine, the address other nodes reach it at.

    The IP is `$SLIME_HOST_IP` when set (upstream's override for machines with several interfaces), else
    Ray's address for this node: the running Ray node's, or the interface that routes outward.
    """
    import ray.util

    return socket.gethostname(), os.environ.get("SLIME_HOST_IP") or ray.util.get_node_ip_address()


def router_launch_args(args: Any) -> Any:
    """The args `run_router` launches sglang-router with: a copy of `args` whose `host` and `prometheus_host`, where
    not given, are 127.0.0.1 (sglang-router's own default is every interface; slime's servers bind the loopback
    unless told otherwise).

    Args:
        args: sglang-router's `RouterArgs` (its `host` always has a value, so only `prometheus_host` is filled in),
            or a namespace of its command-line fields (a missing or None field is filled in).
    """
    if dataclasses.is_dataclass(args):
        return dataclasses.replace(args, prometheus_host=args.prometheus_host or LOOPBACK)
    fields = dict(vars(args))
    for name in ("host", "prometheus_host"):
        if fields.get(name) is None:
            fields[name] = LOOPBACK
    return argparse.Namespace(**fields)


def run_router(args: Any) -> int:
    """Upstream's router runner: serve sglang-router in this process until it stops.

    It blocks, so upstream runs it as a `multiprocessing.Process` target (stop that with `terminate_process`).
    It is what `python -m sglang_router.launch_router` runs (slime launches its own routers with the same flags
    through `slime.backends.sglang_utils.launch_router`).

    Args:
        args: sglang-router's `RouterArgs`, or a namespace of its command-line fields. The router and its metrics
            bind 127.0.0.1 unless `host` / `prometheus_host` say otherwise (`router_launch_args`).

    Returns:
        0 when the router stopped, 1 when it failed to start or crashed (the error is logged).
    """
    from sglang_router.launch_router import launch_router

    try:
        launch_router(router_launch_args(args))
    except Exception:
        logger.exception("sglang-router failed")
        return 1
    return 0


def terminate_process(process: multiprocessing.Process, timeout: float = 1.0) -> None:
    """Stop `process` and every process it started: SIGTERM to all, then SIGKILL to what is left after `timeout` s.

    A process that is not running is left alone. Its descendants are listed before the signals, while they are
    still its children (once it exits they are re-parented and cannot be told apart).
    """
    if not process.is_alive():
        return
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    deadline = time.monotonic() + timeout
    process.terminate()
    for descendant in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            descendant.terminate()
    process.join(timeout)
    # psutil waits on the descendants only: it must not reap `process`, whose exit status multiprocessing collects.
    _, survivors = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
    if process.is_alive():
        process.kill()
        process.join()
    for survivor in survivors:
        with contextlib.suppress(psutil.NoSuchProcess):
            survivor.kill()
    psutil.wait_procs(survivors, timeout=timeout)


def _can_bind(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def tail_file(path: str | Path | None, num_lines: int = 50) -> str:
    """Return the last `num_lines` lines of a text file, or "" when there is no such file."""
    if path is None or not Path(path).exists():
        return ""
    with open(path, errors="replace") as f:
        return "".join(deque(f, maxlen=num_lines))


def _log_tail_section(log_path: str | Path | None) -> str:
    if log_path is None:
        return ""
    tail = tail_file(log_path)
    if not tail:
        return f"\n(log {log_path} is empty)"
    return f"\n--- last lines of {log_path} ---\n{tail.rstrip()}\n--- end of log ---"


def wait_until_healthy(
    url: str,
    timeout: float,
    process: subprocess.Popen | None = None,
    log_path: str | Path | None = None,
    poll_interval: float = 0.5,
) -> None:
    """Poll `url` with GET until it answers HTTP 200.

    Args:
        url: Full health URL, e.g. "http://127.0.0.1:30000/health".
        timeout: Seconds to wait before giving up.
        process: The server process; if it exits first we stop waiting and say so.
        log_path: The server's log file; its last 50 lines go into the error.
        poll_interval: Seconds between polls.

    Raises:
        RuntimeError: `process` exited before `url` became healthy.
        TimeoutError: `url` was not healthy after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"server process (pid {process.pid}) exited with code {process.returncode} before {url} "
                f"became healthy{_log_tail_section(log_path)}"
            )
        try:
            with _opener.open(url, timeout=min(5.0, timeout)) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not up yet
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"{url} was not healthy after {timeout:g}s; raise the startup timeout if the server is just slow"
                f"{_log_tail_section(log_path)}"
            )
        time.sleep(poll_interval)


def _decode_body(body: bytes) -> Any:
    """JSON when the body is JSON (SGLang's control endpoints), text otherwise (/flush_cache, /health)."""
    text = body.decode("utf-8", errors="replace")
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def request_json(
    method: str,
    url: str,
    payload: Any = None,
    timeout: float | None = 60.0,
    max_retries: int = 3,
    retry_delay: float = 0.5,
    headers: dict[str, str] | None = None,
) -> Any:
    """Send one HTTP request with an optional JSON body and return the decoded response.

    Args:
        method: "GET", "POST", "DELETE", ...
        url: Full URL.
        payload: JSON-serializable body, or None for no body.
        timeout: Socket timeout in seconds (None waits forever).
        max_retries: Extra attempts when the connection fails (refused, reset) or the status is 502/503.
        retry_delay: First backoff in seconds; doubles after each failed attempt.
        headers: Extra request headers, e.g. {"Authorization": "Bearer <key>"}.

    Returns:
        The parsed JSON body, the text body if it is not JSON, or None for an empty body.

    Raises:
        HTTPRequestError: The server answered with a status >= 400 (after retries for 502/503).
        ConnectionError: The server could not be reached after all retries.
    """
    data = None if payload is None else json.dumps(payload).encode()
    headers = ({"Content-Type": "application/json"} if data is not None else {}) | (headers or {})
    attempt = 0
    while True:
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with _opener.open(request, timeout=timeout) as response:
                return _decode_body(response.read())
        except urllib.error.HTTPError as e:
            error = HTTPRequestError(method, url, e.code, e.read().decode("utf-8", errors="replace"))
            if e.code not in RETRYABLE_STATUSES or attempt == max_retries:
                raise error from None
        except (urllib.error.URLError, ConnectionError) as e:
            if isinstance(e, urllib.error.URLError) and isinstance(e.reason, TimeoutError):
                raise TimeoutError(f"{method} {url} timed out after {timeout}s") from e
            if attempt == max_retries:
                raise ConnectionError(f"{method} {url} failed after {max_retries + 1} attempts: {e}") from e
        time.sleep(retry_delay * 2**attempt)
        attempt += 1


def post_json(
    url: str, payload: Any = None, timeout: float | None = 60.0, max_retries: int = 3, headers: dict | None = None
) -> Any:
    """POST `payload` as JSON to `url`; see `request_json` for retries, headers, return value and errors."""
    return request_json("POST", url, payload, timeout=timeout, max_retries=max_retries, headers=headers)


def get_json(url: str, timeout: float | None = 60.0, max_retries: int = 3, headers: dict | None = None) -> Any:
    """GET `url`; see `request_json` for retries, headers, return value and errors."""
    return request_json("GET", url, None, timeout=timeout, max_retries=max_retries, headers=headers)


_async_session: aiohttp.ClientSession | None = None
_async_session_loop: asyncio.AbstractEventLoop | None = None
# Connections one shared session may hold at once; 0 is no cap. Set by `init_http_client`.
_connection_limit = 0


def _shared_session() -> aiohttp.ClientSession:
    """One session per event loop: aiohttp sessions cannot cross loops, and a new session per request
    would open a new connection per request."""
    import aiohttp

    global _async_session, _async_session_loop
    loop = asyncio.get_running_loop()
    if _async_session is None or _async_session.closed or _async_session_loop is not loop:
        # No cap by default: the rollout decides concurrency (--sglang-server-concurrency), not the connection pool.
        _async_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=_connection_limit), timeout=aiohttp.ClientTimeout(total=None)
        )
        _async_session_loop = loop
    return _async_session


def init_http_client(args: Any) -> None:
    """Upstream's setup call for `post` and `get`: cap the connections of the shared aiohttp session at what the
    engines serve at once, `--sglang-server-concurrency` x engines, as upstream's client is capped.

    `post` and `get` work without it (the session is made on first use in each event loop); a session made
    before the call keeps its cap.
    """
    global _connection_limit
    _connection_limit = args.sglang_server_concurrency * max(1, args.rollout_num_engines)


async def close_async_session() -> None:
    """Close the shared aiohttp session of the running loop, if any (call before the loop ends)."""
    global _async_session, _async_session_loop
    if _async_session is not None and _async_session_loop is asyncio.get_running_loop():
        await _async_session.close()
        _async_session, _async_session_loop = None, None


async def async_post_json(
    url: str,
    payload: Any,
    timeout: float | None = None,
    max_retries: int = 3,
    retry_delay: float = 0.5,
    retry_failures_for: float = 0.0,
    headers: dict[str, str] | None = None,
) -> Any:
    """POST `payload` as JSON with the shared aiohttp session and return the decoded response.

    Args:
        url: Full URL, e.g. f"http://{router_ip}:{router_port}/generate".
        payload: JSON-serializable body.
        timeout: Total seconds for one attempt (None waits forever).
        max_retries: Extra attempts when the connection fails or the status is 502/503.
        retry_delay: First backoff in seconds; doubles after each failed attempt.
        retry_failures_for: Also retry any 5xx status and timeouts, every second, until this many
            seconds have passed since the first attempt (`--use-fault-tolerance`: the router still
            routes to an engine that is being taken out and replaced).
        headers: Extra request headers (e.g. an engine's `Authorization`).

    Returns:
        The parsed JSON body, or the text body if it is not JSON.

    Raises:
        HTTPRequestError: The server answered with a status >= 400 (after retries for 502/503).
        ConnectionError: The server could not be reached after all retries.
    """
    import aiohttp

    session = _shared_session()
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    give_up_at = time.monotonic() + retry_failures_for
    attempt = 0
    while True:
        keep_trying = time.monotonic() < give_up_at
        try:
            async with session.post(url, json=payload, timeout=client_timeout, headers=headers) as response:
                body = await response.read()
                if response.status < 400:
                    return _decode_body(body)
                error = HTTPRequestError("POST", url, response.status, body.decode("utf-8", errors="replace"))
                retryable = response.status in RETRYABLE_STATUSES or (keep_trying and response.status >= 500)
                if not retryable or (attempt >= max_retries and not keep_trying):
                    raise error
        # Refused/reset connections and servers that went away; timeouts only while `retry_failures_for` lasts.
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, asyncio.TimeoutError) as e:
            if isinstance(e, asyncio.TimeoutError) and not keep_trying:
                raise
            if attempt >= max_retries and not keep_trying:
                raise ConnectionError(f"POST {url} failed after {attempt + 1} attempts: {e!r}") from e
        await asyncio.sleep(1.0 if keep_trying else retry_delay * 2**attempt)
        attempt += 1


async def post(
    url: str, payload: Any, max_retries: int = 60, headers: dict[str, str] | None = None, timeout: float | None = None
) -> Any:
    """Upstream slime's async POST helper (custom generate functions call it on the router's /generate).

    `async_post_json` that, like upstream's, keeps retrying about `max_retries` times a second apart: while a
    connection fails or the server answers 5xx, for up to `max_retries` seconds. A 4xx answer raises at once.

    Returns:
        The parsed JSON body, or the text body if it is not JSON.
    """
    return await async_post_json(
        url, payload, timeout=timeout, max_retries=0, retry_failures_for=float(max_retries), headers=headers
    )


async def get(url: str) -> Any:
    """Upstream's async GET helper: GET `url` with the shared aiohttp session, no retries.

    Returns:
        The parsed JSON body, or the text body if it is not JSON.

    Raises:
        HTTPRequestError: The server answered with a status >= 400.
    """
    async with _shared_session().get(url) as response:
        body = await response.read()
        if response.status >= 400:
            raise HTTPRequestError("GET", url, response.status, body.decode("utf-8", errors="replace"))
    return _decode_body(body)
