"""Push the trainer's weights to the inference engines (SGLang on GPU, slime's CPU engine on CPU).

Both transports gather each FSDP-sharded parameter to a full tensor (`DTensor.full_tensor()`, a
collective every training rank joins), under its HuggingFace name, and send buckets of at most
`--update-weight-buffer-size` bytes (a larger single tensor goes alone):

- colocated (`--colocate`), `send_buckets_as_tensors`: engine `e` is served by training ranks
  `[e * g, (e + 1) * g)` (g = `--rollout-num-gpus-per-engine`). Each of those ranks pickles its
  bucket with torch's shared-memory reductions (CUDA IPC handles on GPU, named shared memory with
  the `file_system` strategy on CPU), base64-encodes it, and the first rank of the span posts one
  payload per engine TP rank to `/update_weights_from_tensor`. Only same-host engines can map it.
- disaggregated, `send_buckets_by_broadcast`: training rank 0 forms a process group of its own
  with every engine rank (`connect_broadcast_group`: NCCL between GPUs, gloo when either side is
  on CPU; its own TCP store, not the training group, built the way SGLang builds it, which slime's
  CPU engine follows too), then per bucket posts the names/dtypes/shapes to
  `/update_weights_from_distributed` and broadcasts the tensors in that order.

The payload format and the group construction live in `slime.utils.weight_transport`, shared with
the engines that receive.

The caller (`FSDPTrainRayActor.update_weights`) pauses the engines and flushes their caches first,
resumes them afterwards, and labels every update with the next integer weight version.

Engines are Ray actor handles of `RolloutEngine` or plain clients with the same methods
(`EngineClient`); `call_engine` calls either.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils.model import reshard
from slime.ray.train_actor import get_free_port
from slime.utils.weight_transport import init_process_group_like_sglang, serialize_named_tensors

GROUP_NAME = "slime_weight_update"


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


def full_parameter_buckets(
    model: nn.Module, buffer_size: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full parameters by HF name, in buckets of at most `buffer_size` bytes; every rank must iterate it all.

    Args:
        model: The FSDP-sharded causal LM (tied parameters appear once, under their first name).
        buffer_size: Bucket byte limit (`--update-weight-buffer-size`).
        dtype: Cast to this dtype before sending (None keeps the parameter dtype).

    Yields:
        Lists of (name, full tensor on the training device).
    """
    reshard(model)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        full = full.detach().to(dtype or full.dtype).contiguous()
        nbytes = full.numel() * full.element_size()
        if bucket and size + nbytes > buffer_size:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full))
        size += nbytes
    if bucket:
        yield bucket


# ---------------------------------------------------------------------------------------------
# Colocated: tensors through shared memory
# ---------------------------------------------------------------------------------------------


def engine_span_groups(world_size: int, gpus_per_engine: int) -> list[dist.ProcessGroup | None]:
    """Gloo subgroups of the ranks serving each colocated engine (None when an engine has one rank).

    A collective over the default group: every rank must call it, in the same order.
    """
    if gpus_per_engine == 1:
        return [None] * world_size
    groups = []
    for start in range(0, world_size, gpus_per_engine):
        groups.append(dist.new_group(list(range(start, start + gpus_per_engine)), backend="gloo"))
    return groups


def send_buckets_as_tensors(
    model: nn.Module,
    engines: list,
    rank: int,
    gpus_per_engine: int,
    span_groups: list[dist.ProcessGroup | None],
    weight_version: str,
    buffer_size: int,
    dtype: torch.dtype | None = None,
) -> None:
    """Colocated update: every rank joins each bucket's gather; the first rank of each engine's span posts.

    Args:
        model: The sharded causal LM.
        engines: One handle per colocated engine, engine `e` on ranks `[e * g, (e + 1) * g)`.
        rank: This training rank.
        gpus_per_engine: `g`, the engine's TP size.
        span_groups: From `engine_span_groups`.
        weight_version: Label the engines report afterwards.
        buffer_size: Bucket byte limit.
        dtype: Send dtype (None: the parameter dtype).
    """
    engine_index = rank // gpus_per_engine
    engine = engines[engine_index] if engine_index < len(engines) else None
    span_start = engine_index * gpus_per_engine
    for bucket in full_parameter_buckets(model, buffer_size, dtype):
        if engine is None:
            continue
        payload = serialize_named_tensors(bucket)
        if gpus_per_engine == 1:
            payloads = [payload]
        else:
            payloads = [None] * gpus_per_engine if rank == span_start else None
            dist.gather_object(payload, payloads, dst=span_start, group=span_groups[engine_index])
        if rank == span_start:
            call_engine(
                engine,
                "update_weights_from_tensor",
                serialized_named_tensors=payloads,
                flush_cache=False,
                weight_version=weight_version,
            )


# ---------------------------------------------------------------------------------------------
# Disaggregated: broadcast over a separate process group
# ---------------------------------------------------------------------------------------------


@dataclass
class BroadcastGroup:
    """Training rank 0's side of the weight-broadcast group.

    Attributes:
        group: The process group (this process is rank 0).
        name: Its name on the engines.
    """

    group: dist.ProcessGroup
    name: str


def connect_broadcast_group(
    engines: list, gpus_per_engine: int, master_address: str, engine_kind: str
) -> BroadcastGroup:
    """Form the weight-broadcast group: this process (training rank 0) as rank 0, then every engine rank.

    Every side builds the group with SGLang's store layout (`init_process_group_like_sglang`).
    The engines are asked to join (`init_weights_update_group`) concurrently with this process
    creating the store, since each side waits for the other. Each call makes a group with a new
    name, so a trainer can reconnect to restarted engines.

    Args:
        engines: Engine handles; engine `e` takes ranks `1 + e * g ... (e + 1) * g`.
        gpus_per_engine: `g`, ranks per engine.
        master_address: Address of this process that every engine can reach.
        engine_kind: "sglang" or "cpu" (`--rollout-backend`); picks the collective backend: NCCL for
            SGLang when this process has CUDA, gloo otherwise (the CPU engine only speaks gloo).

    Returns:
        The group; pass it to `send_buckets_by_broadcast`.
    """
    name = f"{GROUP_NAME}_{uuid.uuid4().hex[:12]}"
    backend = "nccl" if engine_kind == "sglang" and torch.cuda.is_available() else "gloo"
    port = get_free_port(master_address)
    world_size = 1 + len(engines) * gpus_per_engine
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
        group = init_process_group_like_sglang(backend, master_address, port, 0, world_size, name)
        for join in joins:
            join.result()
    return BroadcastGroup(group, name)


def send_buckets_by_broadcast(
    model: nn.Module,
    engines: list,
    group: BroadcastGroup | None,
    weight_version: str,
    buffer_size: int,
    dtype: torch.dtype | None = None,
) -> None:
    """Disaggregated update: every rank joins each bucket's gather; rank 0 (holding `group`) sends.

    Args:
        model: The sharded causal LM.
        engines: Engine handles (used on rank 0 only).
        group: From `connect_broadcast_group` on rank 0; None on the other ranks.
        weight_version: Label the engines report afterwards.
        buffer_size: Bucket byte limit.
        dtype: Send dtype (None: the parameter dtype).
    """
    for bucket in full_parameter_buckets(model, buffer_size, dtype):
        if group is None:
            continue
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            receives = [
                pool.submit(
                    call_engine,
                    engine,
                    "update_weights_from_distributed",
                    names=[name for name, _ in bucket],
                    dtypes=[str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
                    shapes=[list(tensor.shape) for _, tensor in bucket],
                    group_name=group.name,
                    flush_cache=False,
                    weight_version=weight_version,
                )
                for engine in engines
            ]
            for _, tensor in bucket:
                dist.broadcast(tensor, src=0, group=group.group)
            for receive in receives:
                receive.result()


# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------


def probe_tokens(vocab_size: int, length: int = 24) -> list[int]:
    """A fixed token sequence spread over the vocabulary, for comparing trainer and engine log-probs."""
    return [(7 * i + 3) % vocab_size for i in range(length)]


def engine_prompt_log_probs(engine: Any, input_ids: list[int]) -> list[float]:
    """Log-probs the engine assigns to `input_ids[1:]` given their prefixes (temperature 1, no generation)."""
    response = call_engine(
        engine,
        "generate",
        payload={
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    entries = response["meta_info"]["input_token_logprobs"]
    return [entry[0] for entry in entries[1:]]
