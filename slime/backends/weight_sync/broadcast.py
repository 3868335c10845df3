"""Engines anywhere: training rank 0 broadcasts every bucket over a process group it forms with every engine rank.

The group is built the way SGLang builds it (`slime.utils.weight_transport.init_process_group_like_sglang`):
NCCL between GPUs, gloo when either side is on CPU.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

import ray
import torch.distributed as dist

from slime.backends.weight_sync.base import WeightTransport, call_engine
from slime.utils.device import cuda_available
from slime.utils.fp8 import fp8_wire_view
from slime.utils.weight_sync import Bucket
from slime.utils.weight_transport import host_group_store, init_process_group_like_sglang

GROUP_NAME = "slime_weight_update"


@dataclass
class BroadcastGroup:
    """Training rank 0's side of the weight-broadcast group.

    Attributes:
        group: The process group (this process is rank 0).
        name: Its name on the engines.
    """

    group: dist.ProcessGroup
    name: str


def connect_broadcast_group(engines: list, gpus_per_engine: int, master_address: str, backend: str) -> BroadcastGroup:
    """Form the weight-broadcast group: this process (training rank 0) as rank 0, then every engine rank.

    Every side builds the group with SGLang's store layout (`init_process_group_like_sglang`).
    The engines are asked to join (`init_weights_update_group`) concurrently with this process
    creating the store, since each side waits for the other. Each call makes a group with a new
    name, so a trainer can reconnect to restarted engines.

    Args:
        engines: Engine handles; engine `e` takes ranks `1 + e * g ... (e + 1) * g`.
        gpus_per_engine: `g`, ranks per engine.
        master_address: Address of this process that every engine can reach.
        backend: "nccl" or "gloo".
    """
    name = f"{GROUP_NAME}_{uuid.uuid4().hex[:12]}"
    world_size = 1 + len(engines) * gpus_per_engine
    store = host_group_store(master_address, world_size)  # listening before any engine is told its port
    port = store.port
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        joins = [
            pool.submit(
                call_engine,
                engine,
                "init_weights_update_group",
                master_address=master_address,
                master_port=port,
                rank_offset=1 + index * gpus_per_engine,
                world_size=world_size,
                group_name=name,
                backend=backend,
            )
            for index, engine in enumerate(engines)
        ]
        group = init_process_group_like_sglang(backend, master_address, port, 0, world_size, name, store=store)
        for join in joins:
            join.result()
    return BroadcastGroup(group, name)


class BroadcastTransport(WeightTransport):
    """Disaggregated engines: rank 0 (holding the group) posts each bucket's names, dtypes and shapes to
    `/update_weights_from_distributed` on every engine and broadcasts the tensors in that order; the other
    ranks only produce the buckets.

    Args:
        gpus_per_engine: `--rollout-num-gpus-per-engine`, ranks per engine in the group.
        engine_kind: "sglang" or "cpu" (`--rollout-backend`): NCCL for SGLang when this process has CUDA, gloo
            otherwise (the CPU engine only speaks gloo).
    """

    def __init__(self, gpus_per_engine: int, engine_kind: str):
        self.gpus_per_engine = gpus_per_engine
        self.backend = "nccl" if engine_kind == "sglang" and cuda_available() else "gloo"
        self.group: BroadcastGroup | None = None

    def connect(self, engines: list, engine_urls: list[str], rank: int, world_size: int) -> None:
        super().connect(engines, engine_urls, rank, world_size)
        if rank != 0 or not self.engines:
            return
        # Engines listen on 127.0.0.1 only on a one-node cluster (`PlacementSlice.host`), on their node's IP otherwise.
        local = all(urlparse(url).hostname in ("127.0.0.1", "localhost") for url in engine_urls)
        address = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self.group = connect_broadcast_group(self.engines, self.gpus_per_engine, address, self.backend)

    def push(self, buckets: Iterable[Bucket], version: str) -> None:
        for bucket in buckets:
            if self.group is None:
                continue
            with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
                receives = [
                    pool.submit(
                        call_engine,
                        engine,
                        "update_weights_from_distributed",
                        names=[name for name, _ in bucket],
                        dtypes=[str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
                        shapes=[list(tensor.shape) for _, tensor in bucket],
                        group_name=self.group.name,
                        flush_cache=False,
                        weight_version=version,
                    )
                    for engine in self.engines
                ]
                for _, tensor in bucket:
                    # gloo has no FP8 type: FP8 tensors go as their bytes (the CPU engine receives them so)
                    wire = fp8_wire_view(tensor) if self.backend == "gloo" else tensor
                    dist.broadcast(wire, src=0, group=self.group.group)
                for receive in receives:
                    receive.result()

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group.group)
            self.group = None
