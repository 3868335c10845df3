"""The interface every weight transport implements, and the calls the trainer makes to engines.

Engines are Ray actor handles of `RolloutEngine` or plain clients with the same methods (`EngineClient`,
e.g. for `--rollout-external-engine-addrs`); `call_engine` calls either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from slime.utils.weight_sync import Bucket


def call_engine(engine: Any, method: str, **kwargs: Any) -> Any:
    """Call `engine.method(**kwargs)` on a Ray actor handle (and wait) or on a plain client object."""
    function = getattr(engine, method)
    remote = getattr(function, "remote", None)
    if remote is not None:
        return ray.get(remote(**kwargs))
    return function(**kwargs)


def call_engines(engines: list, method: str, **kwargs: Any) -> list:
    """`call_engine` on every engine concurrently; returns the results in order, raising the first error."""
    if not engines:
        return []
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        futures = [pool.submit(call_engine, engine, method, **kwargs) for engine in engines]
        return [future.result() for future in futures]


def resume_quietly(engines: list) -> None:
    """After a failed update: resume every engine that still answers, so none is left paused (the caller
    reports the update's error)."""
    for engine in engines:
        with contextlib.suppress(Exception):
            call_engine(engine, "continue_generation")


class WeightTransport:
    """How one training rank sends HF-named weight buckets to the engines; one subclass per transport.

    `WeightUpdater` drives it on every training rank: `connect` once per set of engines, then per update
    `stage` while the engines still serve and `push` while they are paused, and `close` when done. Every
    rank iterates the buckets to the end, because producing them is a collective.

    Attributes:
        every_rank_sends: Whether ranks other than 0 send too (colocated engines, each served by its own span
            of ranks), so every rank needs the whole model's buckets (Megatron's pipeline stages forward theirs).
        staged: Whether `stage` consumes the buckets (disk: writes them out), so the engines pause only for
            `push`, which rank 0 alone runs; otherwise `push` sends the buckets as they are produced, every
            rank taking part, with the engines paused throughout.
        adapter: The LoRA adapter the transport pushes (the engines serve it under this name), or None when it
            pushes the model's weights.
        fp8_block: The engines run block FP8 with this block size (`slime.utils.fp8.rollout_fp8_block`):
            `WeightUpdater` hands the transport every bucket quantized (FP8 weights plus `<name>_scale_inv`).
    """

    every_rank_sends: bool = False
    adapter: str | None = None
    fp8_block: tuple[int, int] | None = None
    staged: bool = False

    def connect(self, engines: list, engine_urls: list[str], rank: int, world_size: int) -> None:
        """Prepare this rank for pushes to `engines` (a collective where a transport forms process groups).

        Args:
            engines: Engine handles.
            engine_urls: Their base URLs (where the engines are, for the address they reach this rank at).
            rank: This training rank.
            world_size: Number of training ranks.
        """
        self.engines, self.rank = list(engines), rank

    def stage(self, buckets: Iterable[Bucket], version: str) -> Any:
        """Work done before the engines pause; returns what `push` takes (by default the buckets, untouched)."""
        return buckets

    def push(self, buckets: Any, version: str) -> None:
        """Send one update to the engines under weight version `version`.

        Args:
            buckets: What `stage` returned: the HF-named tensor buckets, produced lazily while sending, unless the
                transport is `staged`.
            version: The label the engines report afterwards.
        """
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what `connect` set up on this side (the engines keep the weights they have)."""
