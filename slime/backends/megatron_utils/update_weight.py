"""Push the Megatron trainer's weights to the inference engines under HuggingFace names.

Each parameter is gathered over tensor (and expert) parallelism and converted to its HF names by
`megatron_to_hf.megatron_state_to_hf` (a collective every rank of the stage joins), then sent in
buckets of at most `--update-weight-buffer-size` bytes through the transport of
`slime.utils.weight_transport`, the same one the FSDP backend uses:

- colocated (`--colocate`), `send_buckets_as_tensors`: engine `e` is served by training ranks
  `[e * g, (e + 1) * g)` (g = `--rollout-num-gpus-per-engine`); each of them serializes its copy of
  the bucket (CUDA IPC handles / shared memory) and the first rank of the span posts one payload per
  engine TP rank to `/update_weights_from_tensor`.
- disaggregated, `send_buckets_by_broadcast`: training rank 0 forms a process group of its own with
  every engine rank (`connect_broadcast_group`) and, per bucket, posts names/dtypes/shapes to
  `/update_weights_from_distributed` and broadcasts the tensors in that order.

Every training rank holds full tensors after the gather, so no extra data-parallel traffic is needed.
Pipeline parallelism is not handled here yet: `update_weights` refuses it.
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

from slime.backends.megatron_utils.megatron_to_hf import megatron_state_to_hf
from slime.ray.train_actor import get_free_port
from slime.utils.weight_transport import init_process_group_like_sglang, serialize_named_tensors

GROUP_NAME = "slime_megatron_weight_update"


def call_engine(engine: Any, method: str, **kwargs: Any) -> Any:
    """Call `engine.method(**kwargs)` on a Ray actor handle (and wait) or on a plain client object."""
    function = getattr(engine, method)
    remote = getattr(function, "remote", None)
    if remote is not None:
        return ray.get(remote(**kwargs))
    return function(**kwargs)


def call_engines(engines: list, method: str, **kwargs: Any) -> list:
    """`call_engine` on every engine concurrently; results in order, the first error raised."""
    if not engines:
        return []
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        return [f.result() for f in [pool.submit(call_engine, e, method, **kwargs) for e in engines]]


def hf_weight_buckets(
    model: list[nn.Module], family: str, vocab_size: int, buffer_size: int, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full HF-named tensors of the model in buckets of at most `buffer_size` bytes (a collective).

    Args:
        model: The model chunks (wrapped or not).
        family: Model family for the name mapping (e.g. "qwen3").
        vocab_size: The true vocabulary (padded rows are dropped).
        buffer_size: Bucket byte limit (a larger tensor goes alone).
        dtype: Cast to this dtype (None keeps the parameter dtype).

    Yields:
        Lists of (HF name, contiguous tensor on the training device, never aliasing a parameter).
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in megatron_state_to_hf(model, family, vocab_size):
        tensor = tensor.detach().to(dtype or tensor.dtype).clone(memory_format=torch.contiguous_format)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > buffer_size:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def engine_span_groups(world_size: int, gpus_per_engine: int) -> list[dist.ProcessGroup | None]:
    """Gloo subgroups of the ranks serving each colocated engine (None when an engine has one rank).

    A collective over the default group: every rank calls it, in the same order.
    """
    if gpus_per_engine == 1:
        return [None] * max(world_size, 1)
    return [
        dist.new_group(list(range(start, start + gpus_per_engine)), backend="gloo")
        for start in range(0, world_size, gpus_per_engine)
    ]


def send_buckets_as_tensors(
    buckets: Iterator[list[tuple[str, torch.Tensor]]],
    engines: list,
    rank: int,
    gpus_per_engine: int,
    span_groups: list[dist.ProcessGroup | None],
    weight_version: str,
) -> None:
    """Colocated update: every rank consumes every bucket; the first rank of each engine's span posts.

    Args:
        buckets: From `hf_weight_buckets` (every rank iterates it to the end: it is a collective).
        engines: Engine handles; engine `e` sits on ranks `[e * g, (e + 1) * g)`.
        rank: This training rank.
        gpus_per_engine: `g`.
        span_groups: From `engine_span_groups`.
        weight_version: Label the engines report afterwards.
    """
    engine_index = rank // gpus_per_engine
    engine = engines[engine_index] if engine_index < len(engines) else None
    span_start = engine_index * gpus_per_engine
    for bucket in buckets:
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


@dataclass
class BroadcastGroup:
    """Training rank 0's side of the weight-broadcast group (`group`, registered as `name` on the engines)."""

    group: dist.ProcessGroup
    name: str


def connect_broadcast_group(
    engines: list, gpus_per_engine: int, master_address: str, engine_kind: str
) -> BroadcastGroup:
    """Form the weight-broadcast group: this process (training rank 0) as rank 0, then every engine rank.

    The engines are asked to join (`init_weights_update_group`) while this process creates the
    store, since each side waits for the other.

    Args:
        engines: Engine handles; engine `e` takes ranks `1 + e * g ... (e + 1) * g`.
        gpus_per_engine: `g`.
        master_address: An address of this process every engine can reach.
        engine_kind: `--rollout-backend` ("sglang" or "cpu"): NCCL for SGLang with CUDA here, else gloo.
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
    buckets: Iterator[list[tuple[str, torch.Tensor]]],
    engines: list,
    group: BroadcastGroup | None,
    weight_version: str,
) -> None:
    """Disaggregated update: every rank consumes every bucket; rank 0 (holding `group`) sends them.

    Args:
        buckets: From `hf_weight_buckets`.
        engines: Engine handles (used on rank 0 only).
        group: From `connect_broadcast_group` on rank 0; None elsewhere.
        weight_version: Label the engines report afterwards.
    """
    for bucket in buckets:
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
    return [entry[0] for entry in response["meta_info"]["input_token_logprobs"][1:]]
