"""Colocated engines on this host, CPU tensors: buckets copied into sealed memory segments the engine's weights live in.

The wire format (segments, JSON layout, the receiving side) is `slime.utils.weight_transport`'s.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from slime.backends.weight_sync.base import WeightTransport, call_engine
from slime.utils.weight_sync import Bucket, bucket_named_tensors
from slime.utils.weight_transport import SEGMENT_BYTES, SHARED_MEMORY_FORMAT, stage_named_tensors


class SharedMemoryTransport(WeightTransport):
    """Engine `e` is served by training ranks `[e * g, (e + 1) * g)`; the first rank of the span posts.

    That rank asks the engine which segments its weights live in (an update of no tensors), then copies each
    bucket, in chunks of at most `SEGMENT_BYTES`, into shared-memory segments it keeps for later pushes and
    that are not among those (`stage_named_tensors`); it posts each chunk to `/update_weights_from_tensor`
    from a background thread while it copies the next one, and the engine's weights then live in those
    segments: one copy per push. Only an engine on this host can map them.

    Args:
        gpus_per_engine: `g`, `--rollout-num-gpus-per-engine` (the CPU engine is one process whatever its span).
        tag: The job's `segment_tag` (from the engines' API key), which the engines require in segment names.
    """

    every_rank_sends = True

    def __init__(self, gpus_per_engine: int, tag: str | None = None):
        self.gpus_per_engine = gpus_per_engine
        self.tag = tag

    def push(self, buckets: Iterable[Bucket], version: str) -> None:
        engine_index = self.rank // self.gpus_per_engine
        engine = self.engines[engine_index] if engine_index < len(self.engines) else None
        if engine is None or self.rank != engine_index * self.gpus_per_engine:
            for _ in buckets:
                pass
            return
        post = functools.partial(
            call_engine,
            engine,
            "update_weights_from_tensor",
            load_format=SHARED_MEMORY_FORMAT,
            flush_cache=False,
            weight_version=version,
        )
        held: set[str] | None = None  # segments the engine's weights live in when the push starts
        posts: deque[Future] = deque()  # in flight, oldest first
        chunks = 0
        # One poster thread: chunks reach the engine in order, one request at a time.
        with ThreadPoolExecutor(max_workers=1) as poster:
            for bucket in buckets:
                if held is None:  # an update of no tensors: which segments do the engine's weights live in?
                    held = set(post(serialized_named_tensors=[])["segments_in_use"])
                for chunk in bucket_named_tensors(bucket, SEGMENT_BYTES):
                    if len(posts) == 2:  # stop early on a refused chunk
                        posts.popleft().result()
                    payload = stage_named_tensors(chunk, chunks, held, self.tag)
                    posts.append(poster.submit(post, serialized_named_tensors=[payload]))
                    chunks += 1
            while posts:
                posts.popleft().result()
