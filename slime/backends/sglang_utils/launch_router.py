"""`python -m slime.backends.sglang_utils.launch_router <sglang-router flags>`: runs what `python -m
sglang_router.launch_router` runs, with the same flags, but without importing sglang-router's Python load balancer
(FastAPI, aiohttp) when the Rust router is what serves. That import was most of a router start's CPU time
(~0.5-1.3 CPU-s, paid by every run and every router restart)."""

from __future__ import annotations

import argparse
import sys

import setproctitle
from sglang_router.router_args import RouterArgs


def parse_router_args(argv: list[str]) -> RouterArgs:
    """sglang-router's flags (those of `python -m sglang_router.launch_router`), parsed as its launcher does."""
    parser = argparse.ArgumentParser(prog="python -m slime.backends.sglang_utils.launch_router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)


def main() -> None:
    router_args = parse_router_args(sys.argv[1:])
    if router_args.mini_lb:  # the Python load balancer: upstream's launcher runs it
        from sglang_router.launch_router import launch_router

        launch_router(router_args)
        return
    from sglang_router.router import Router  # the Rust router (upstream's launcher needs it only here too)

    setproctitle.setproctitle("sglang::router")  # the name upstream's launcher gives the process
    router_args._validate_router_args()
    Router.from_args(router_args).start()


if __name__ == "__main__":
    main()
