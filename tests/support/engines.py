"""A real CPU engine server process for tests: started on a free port, stopped when the test is done."""

from __future__ import annotations

import contextlib
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import torch

from slime.backends import weight_sync
from slime.backends.sglang_utils.http_client import EngineClient
from slime.backends.sglang_utils.router import add_worker, router_cli_parser, start_router, wait_for_workers
from slime.utils.http_utils import find_free_port, wait_until_healthy
from support.ranks import ForkedProcess

REPO_ROOT = Path(__file__).resolve().parents[2]


def _serve(argv: list[str]) -> None:
    from slime.backends.cpu_engine.server import parse_args, run_server

    run_server(parse_args(argv))


@contextlib.contextmanager
def engine_server(model_dir: str | Path, *flags: str) -> Iterator[tuple[ForkedProcess, str]]:
    """The CPU engine server (what `python -m slime.backends.cpu_engine` runs) in a process of its own, forked
    with its imports done (support.ranks), on a free port with one thread and `flags`; yields (process, base URL)
    once it is healthy, and stops it (SIGTERM, then SIGKILL after 30 s) on exit."""
    port = find_free_port()
    argv = ["--model-path", str(model_dir), "--port", str(port), "--num-threads", "1", *flags]
    process = ForkedProcess(_serve, (argv,))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{url}/health", 120, process=process)
        yield process, url
    finally:
        process.terminate()
        if process.wait(timeout=30) is None:
            process.kill()
            process.wait()


def router_options(**changed) -> dict:
    """`args.router_args` as slime's parser leaves it: every RouterArgs field at sglang-router's default, plus
    what the user changed."""
    defaults = {action.dest: action.default for action in router_cli_parser()._actions if action.dest != "help"}
    return defaults | changed


def router_args(log_dir: str | Path, request_timeout: float = 120, **changed) -> Namespace:
    """The arguments `start_router` reads: `router_options(**changed)`, a free port on 127.0.0.1, logs under
    `log_dir`."""
    return Namespace(
        sglang_router_ip=None,
        sglang_router_port=None,
        sglang_router_request_timeout_secs=request_timeout,
        router_args=router_options(**changed),
        server_log_dir=str(log_dir),
    )


@contextlib.contextmanager
def router_for(engine_urls: list[str], args: Namespace, api_key: str | None = None) -> Iterator[str]:
    """A real sglang-router started from `args` with `engine_urls` registered; yields its URL, stops it on exit."""
    router = start_router(args)
    try:
        for url in engine_urls:
            add_worker(router.url, url, api_key=api_key)
        wait_for_workers(router.url, engine_urls, timeout=30)
        yield router.url
    finally:
        router.stop()


@contextlib.contextmanager
def cpu_engine_process(model_dir: str | Path, *flags: str) -> Iterator[tuple[EngineClient, str]]:
    """`engine_server` with a client for it; yields (client, base URL)."""
    with engine_server(model_dir, *flags) as (_, url):
        yield EngineClient(url), url


def engine_prompt_log_probs(client: EngineClient, tokens: list[int], lora_path: str | None = None) -> torch.Tensor:
    """The engine's log-prob of every token of `tokens` after the first, at temperature 1 (a scoring request), under
    the loaded adapter `lora_path` if given: the trainer's own probe, as a tensor."""
    return torch.tensor(weight_sync.engine_prompt_log_probs(client, tokens, lora_path))
