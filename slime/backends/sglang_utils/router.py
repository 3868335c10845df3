"""Launch sglang-router and register engines with it.

What sglang-router 0.3.2 does (measured on this machine):
- `python -m sglang_router.launch_router` is one Rust process that renames itself `sglang::router`
  (no children) and exits within ~1 s of SIGTERM when idle. `--host` and `--prometheus-host` default
  to 0.0.0.0, so slime binds both explicitly. slime starts the same router with the same flags through
  `slime.backends.sglang_utils.launch_router`, which skips the Python load balancer's imports.
- GET /health answers 200 "OK" as soon as it serves, even with no workers; GET /readiness says how many
  workers are healthy. /list_workers does not exist in 0.3.x (404).
- POST /workers {"url"} answers 202 with {"worker_id", "location": "/workers/<id>"} and adds the worker
  in the background (about 1-2 s: it probes the worker's /health, then /get_model_info). An unreachable
  worker is retried for --worker-startup-timeout-secs and never shows up in GET /workers. Posting a
  registered URL again returns the same worker_id but still queues an add job, which re-adds the
  worker if it is deleted before the job runs.
- GET /workers -> {"workers": [{"id", "url", "is_healthy", "load", ...}], "total", "stats"}.
  GET /workers/<id> adds "job_status" while the add is in flight.
- DELETE /workers/<id> answers 202 and removes it in the background; an unknown id answers 400.
- /generate is forwarded with known SGLang fields only (unknown top-level fields are dropped, `rid`
  is kept) and with these added, so a worker must accept them: "model": null, "stream": false,
  "return_text_in_logprobs": false, "log_metrics": true, "return_hidden_states": false,
  "background": false, "no_logs": false, "return_bytes": false, "return_entropy": false.
  POST /flush_cache fans out to all workers.
- The default policy is cache_aware (same prompt prefix -> same worker); `--router-policy round_robin`
  spreads identical prompts.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

from slime.backends.sglang_utils.engine_command_line import drop_parser_defaults, options_to_cli_args
from slime.backends.sglang_utils.server_process import launch_server_process, server_log_path, stop_server_process
from slime.utils.arguments import ROUTER_MANAGED_FIELDS
from slime.utils.http_utils import HTTPRequestError, find_free_port, get_json, request_json, wait_until_healthy

logger = logging.getLogger(__name__)

# Router options slime sets unless a `--router-<flag>` changes them.
DEFAULT_ROUTER_OPTIONS = {
    # A paused or weight-loading engine fails requests for a while; it must not be locked out afterwards.
    "disable_circuit_breaker": True,
    # A runtime /health probe can time out while an engine loads weights; slime watches its engines itself.
    "disable_health_check": True,
    # At "info" the router logs two lines per request.
    "log_level": "warn",
    "prometheus_host": "127.0.0.1",
}


@functools.cache
def router_cli_parser() -> argparse.ArgumentParser:
    """sglang-router's own argument parser, without --host/--port (those come from --sglang-router-ip/port)."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False, exclude_host_port=True)
    return parser


@dataclass
class RouterHandle:
    """A router slime talks to: one it launched (`process` set) or an external one (`process` None).

    Attributes:
        url: Base URL, e.g. "http://127.0.0.1:30000".
        process: The router process when slime launched it.
        log_path: The launched router's log file.
    """

    url: str
    process: Popen | None = None
    log_path: Path | None = None

    def describe_failure(self) -> str:
        """One line on why the router does not serve: its process exited, or it does not answer."""
        if self.process is not None and self.process.poll() is not None:
            return f"the router at {self.url} died (exit code {self.process.returncode}; log: {self.log_path})"
        return f"the router at {self.url} does not answer GET /health"

    def stop(self) -> None:
        """Terminate the router if slime launched it; an external router is left running."""
        if self.process is not None:
            stop_server_process(self.process)


def start_router(args: argparse.Namespace, startup_timeout: float = 60.0) -> RouterHandle:
    """Use the router at `--sglang-router-ip/port` if one is up there, otherwise launch one.

    Args:
        args: Reads `sglang_router_ip`, `sglang_router_port` (a free port on 127.0.0.1 when unset),
            `sglang_router_request_timeout_secs` (default 14400) and `router_args` (dict of
            `--router-<flag>` values forwarded as `--<flag>`; entries equal to sglang-router's own
            defaults are dropped, so slime's defaults above apply); `args` is left as it was (the handle's
            `url` names the router actually used).
        startup_timeout: Seconds to wait for a launched router's /health.

    Returns:
        A handle whose `stop()` ends the router if it was launched here.

    Raises:
        ValueError: `router_args` sets a field slime manages (host, port).
        RuntimeError / TimeoutError: the launched router died or never became healthy (the error carries
            the end of its log).
    """
    host, port = args.sglang_router_ip, args.sglang_router_port
    parser = router_cli_parser()
    router_options = drop_parser_defaults(args.router_args or {}, parser)

    if host and port and _is_healthy(f"http://{host}:{port}"):
        if router_options:
            logger.warning(
                "using the running router at %s:%s; ignoring --router-* flags %s", host, port, router_options
            )
        return RouterHandle(url=f"http://{host}:{port}")

    managed = sorted(set(router_options) & set(ROUTER_MANAGED_FIELDS))
    if managed:
        hints = "; ".join(f"--router-{f.replace('_', '-')}: use {ROUTER_MANAGED_FIELDS[f]}" for f in managed)
        raise ValueError(f"slime sets these router fields itself, remove them from the command line: {hints}")

    host = host or "127.0.0.1"
    port = int(port or find_free_port(host))
    options = {
        "host": host,
        "port": port,
        "prometheus_port": find_free_port("127.0.0.1", exclude={port}),
        "request_timeout_secs": args.sglang_router_request_timeout_secs,
    }
    # A changed --router-* value wins, --router-request-timeout-secs over --sglang-router-request-timeout-secs too.
    options |= DEFAULT_ROUTER_OPTIONS | router_options
    command = [sys.executable, "-m", "slime.backends.sglang_utils.launch_router", *options_to_cli_args(options, parser)]
    log_path = server_log_path(args, f"router_{port}")
    process = launch_server_process(command, log_path)
    url = f"http://{host}:{port}"
    try:
        wait_until_healthy(f"{url}/health", startup_timeout, process=process, log_path=log_path)
    except BaseException:
        stop_server_process(process)
        raise
    logger.info("router serving at %s (log: %s)", url, log_path)
    return RouterHandle(url=url, process=process, log_path=log_path)


def router_is_healthy(router: RouterHandle) -> bool:
    """The router's process (if slime launched it) runs and it answers GET /health."""
    if router.process is not None and router.process.poll() is not None:
        return False
    return _is_healthy(router.url)


def _is_healthy(url: str) -> bool:
    try:
        get_json(f"{url}/health", timeout=5.0, max_retries=0)
    except (HTTPRequestError, ConnectionError, TimeoutError):
        return False
    return True


def list_workers(router_url: str) -> list[dict[str, Any]]:
    """The router's registered workers: dicts with "id", "url", "is_healthy", "load", ..."""
    return get_json(f"{router_url}/workers")["workers"]


def add_worker(router_url: str, worker_url: str, api_key: str | None = None) -> str:
    """Ask the router to add `worker_url`; the router adds it in the background (see `wait_for_workers`).

    A URL the router already lists is left alone: posting it again would queue a background add job
    that re-adds the worker if it is removed before the job runs.

    Args:
        router_url: The router's base URL.
        worker_url: The engine's base URL.
        api_key: The engine's `--api-key` (slime: `--sglang-api-key`). sglang-router 0.3.2 then sends
            `Authorization: Bearer <key>` on everything it forwards to this worker and on its
            /model_info and /server_info probes (its /health probe goes without, which engines allow).
            The router's own `--api-key` is another thing: it makes the router demand a key from its clients.

    Returns:
        The router's id for the worker.
    """
    for worker in list_workers(router_url):
        if worker["url"].rstrip("/") == worker_url.rstrip("/"):
            return worker["id"]
    body = {"url": worker_url} | ({"api_key": api_key} if api_key else {})
    response = request_json("POST", f"{router_url}/workers", body)
    return response["worker_id"]


def wait_for_workers(router_url: str, worker_urls: list[str], timeout: float = 60.0) -> None:
    """Block until every URL in `worker_urls` is registered and healthy in the router.

    Raises:
        TimeoutError: Naming the workers still missing after `timeout` seconds and what the router has.
    """
    wanted = {url.rstrip("/") for url in worker_urls}
    deadline = time.monotonic() + timeout
    while True:
        workers = list_workers(router_url)
        ready = {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}
        if wanted <= ready:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"router {router_url} did not register {sorted(wanted - ready)} within {timeout:.0f}s "
                f"(registered: {[(w['url'], w.get('is_healthy')) for w in workers]}); "
                "check that each worker answers GET /health and GET /get_model_info"
            )
        time.sleep(0.2)


def remove_worker(router_url: str, worker_url: str, timeout: float = 30.0) -> None:
    """Remove `worker_url` from the router and wait until the router no longer lists it.

    Raises:
        ValueError: The router does not know `worker_url`.
        TimeoutError: The worker is still listed after `timeout` seconds.
    """
    worker_url = worker_url.rstrip("/")
    workers = list_workers(router_url)
    worker_ids = [w["id"] for w in workers if w["url"].rstrip("/") == worker_url]
    if not worker_ids:
        raise ValueError(f"router {router_url} has no worker {worker_url}; registered: {[w['url'] for w in workers]}")
    request_json("DELETE", f"{router_url}/workers/{worker_ids[0]}")
    deadline = time.monotonic() + timeout
    while any(w["url"].rstrip("/") == worker_url for w in list_workers(router_url)):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"router {router_url} still lists {worker_url} {timeout:.0f}s after DELETE")
        time.sleep(0.2)
