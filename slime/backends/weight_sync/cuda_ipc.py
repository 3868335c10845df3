"""Colocated engines, CUDA tensors: CUDA IPC handles of the trainer's buckets, as SGLang expects them.

Also the colocated path on a host without memfd: `serialize_named_tensors` then carries CPU tensors by value
inside the payload. The payload format is `slime.utils.weight_transport`'s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from slime.backends.weight_sync.base import WeightTransport, call_engine
from slime.utils.weight_sync import Bucket
from slime.utils.weight_transport import serialize_named_tensors


def engine_span_groups(world_size: int, gpus_per_engine: int) -> list[dist.ProcessGroup | None]:
    """Gloo subgroups of the ranks serving each colocated engine (None when an engine has one rank).

    A collective over the default group: every rank must call it, in the same order.
    """
    if gpus_per_engine == 1:
        return [None] * world_size
    return [
        dist.new_group(list(range(start, start + gpus_per_engine)), backend="gloo")
        for start in range(0, world_size, gpus_per_engine)
    ]


class CudaIpcTransport(WeightTransport):
    """Engine `e` is served by training ranks `[e * g, (e + 1) * g)`, one per engine TP rank.

    Per bucket every rank of the span serializes its copy (`serialize_named_tensors`: IPC handles of its
    GPU's tensors), the span's first rank gathers them and posts one payload per engine TP rank to
    `/update_weights_from_tensor`.

    Args:
        gpus_per_engine: `g`, `--rollout-num-gpus-per-engine`.
    """

    every_rank_sends = True

    def __init__(self, gpus_per_engine: int):
        self.gpus_per_engine = gpus_per_engine
        self.span_groups: list[dist.ProcessGroup | None] = []

    def connect(self, engines: list, engine_urls: list[str], rank: int, world_size: int) -> None:
        super().connect(engines, engine_urls, rank, world_size)
        self.span_groups = engine_span_groups(world_size, self.gpus_per_engine)

    def push(self, buckets: Iterable[Bucket], version: str) -> None:
        engine_index = self.rank // self.gpus_per_engine
        engine = self.engines[engine_index] if engine_index < len(self.engines) else None
        span_start = engine_index * self.gpus_per_engine
        for bucket in buckets:
            if engine is None:
                continue
            payload = serialize_named_tensors(bucket)
            if self.gpus_per_engine == 1:
                payloads = [payload]
            else:
                payloads = [None] * self.gpus_per_engine if self.rank == span_start else None
                dist.gather_object(payload, payloads, dst=span_start, group=self.span_groups[engine_index])
            if self.rank == span_start:
                call_engine(
                    engine,
                    "update_weights_from_tensor",
                    serialized_named_tensors=payloads,
                    flush_cache=False,
                    weight_version=version,
                )

    def close(self) -> None:
        for group in self.span_groups:
            if group is not None:
                dist.destroy_process_group(group)
        self.span_groups = []
