"""Runtime facts of a run: the router, the engines, the number of rollouts, the trainer's weight version.

They are known only once the run is up, so they are no flags: the rollout manager builds a `RunContext` and hands
it to what needs it (its rollout functions, the rollout state). Upstream's user functions read some of them from
`args` (`args.sglang_router_ip`), so `expose_to_plugins` writes them onto the args object the user functions get:
the one place slime writes runtime facts onto args, and slime's own code never reads them back.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field


def _no_engines() -> list[str]:
    return []


def _no_weight_version() -> int | None:
    return None


@dataclass(frozen=True)
class RunContext:
    """What a rollout knows of the run it is part of.

    The engines' URLs and the trainer's weight version change while the run goes on (fault tolerance restarts an
    engine at another URL; every push is a new version), so their owners are asked for them at each call.

    Args:
        num_rollout: Rollout steps of the run (`--num-rollout`, or resolved from `--num-epoch` and the dataset).
        router_host: Host of the router the rollouts send `/generate` to (None without engines).
        router_port: Its port.
        engine_urls_source: Returns the engines' base URLs now.
        weight_version_source: Returns the weight version the trainer trains from (None before the first push).
    """

    num_rollout: int | None = None
    router_host: str | None = None
    router_port: int | None = None
    engine_urls_source: Callable[[], list[str]] = field(default=_no_engines, repr=False, compare=False)
    weight_version_source: Callable[[], int | None] = field(default=_no_weight_version, repr=False, compare=False)

    @property
    def router_url(self) -> str | None:
        """The router's base URL ("http://host:port"), None without one."""
        return None if self.router_host is None else f"http://{self.router_host}:{self.router_port}"

    def engine_urls(self) -> list[str]:
        """The engines' base URLs, as they are now."""
        return list(self.engine_urls_source())

    def trainer_weight_version(self) -> int | None:
        """The weight version the trainer trains from: the n-th push is version n (None before the first)."""
        return self.weight_version_source()


def expose_to_plugins(args: argparse.Namespace, context: RunContext) -> None:
    """Write the facts `context` knows onto `args` under upstream's names, for user functions to read.

    `num_rollout`; with a router, `sglang_router_ip`, `sglang_router_port` and `rollout_engine_urls` (a copy: call
    again when the engines change). A fact the context does not know leaves the flag's value as it was.
    """
    if context.num_rollout is not None:
        args.num_rollout = context.num_rollout
    if context.router_host is not None:
        args.sglang_router_ip, args.sglang_router_port = context.router_host, context.router_port
        args.rollout_engine_urls = context.engine_urls()


def router_url(args: argparse.Namespace, context: RunContext | None) -> str:
    """The router's base URL: the run context's, else the one on `args` (a user function calling a slime helper
    with the args it was given, or a namespace of its own)."""
    if context is not None and context.router_url is not None:
        return context.router_url
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


def engine_urls(args: argparse.Namespace, context: RunContext | None) -> list[str]:
    """The engines' base URLs now: the run context's, else the ones on `args` (see `router_url`)."""
    if context is not None and context.router_host is not None:
        return context.engine_urls()
    return list(getattr(args, "rollout_engine_urls", None) or [])
