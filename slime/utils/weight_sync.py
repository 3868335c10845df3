"""The trainer side of a weight update: talk to the engines and send them buckets of HF-named tensors.

Shared by both training backends; each backend only says how it produces its full HF-named tensors
(FSDP: `DTensor.full_tensor()`; Megatron: tensor-parallel gather + `megatron_to_hf`). Every training
rank iterates the buckets to the end, because producing them is a collective. Three transports
(payload format and group construction in `slime.utils.weight_transport`):

- colocated (`--colocate`), `send_buckets_as_tensors`: engine `e` is served by training ranks
  `[e * g, (e + 1) * g)` (g = `--rollout-num-gpus-per-engine`). On GPU each of those ranks serializes
  its copy of the bucket as CUDA IPC handles and the first rank of the span posts one payload per
  engine TP rank to `/update_weights_from_tensor`; on CPU the first rank copies the bucket into
  shared-memory segments it keeps across pushes and posts their layout, and the engine's weights then live
  in those segments (one copy per push). Only same-host engines can map them.
- disaggregated, `send_buckets_by_broadcast`: training rank 0 forms a process group of its own with
  every engine rank (`connect_broadcast_group`: NCCL between GPUs, gloo when either side is on CPU),
  then per bucket posts the names/dtypes/shapes to `/update_weights_from_distributed` and broadcasts
  the tensors in that order.
- disaggregated with `--update-weight-transport disk`, `send_buckets_by_disk`:
  training rank 0 writes the buckets as HF safetensors shards into a fresh folder under
  `--update-weight-disk-dir` (config and tokenizer files copied from `--hf-checkpoint`, so
  `from_pretrained` of it works), renames it into place, and every engine loads it with
  `/update_weights_from_disk`. The previous push's folder is deleted once the engines hold the new one
  (unless `--update-weight-disk-keep-files`). For engines that cannot reach the trainer but read a
  folder it writes (e.g. `--rollout-external-engine-addrs` on another network).

`update_engine_weights` wraps each transport in the pause / flush / resume protocol the actors use
(disk: the folder is written before the engines pause, so they only stop to load it).
Engines are Ray actor handles of `RolloutEngine` or plain clients with the same methods
(`EngineClient`); `call_engine` calls either.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import tempfile
import uuid
from argparse import Namespace
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import ray
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from slime.utils import atomic_dir
from slime.utils.device import cuda_available
from slime.utils.http_utils import find_free_port
from slime.utils.misc import load_function
from slime.utils.weight_transport import (
    SEGMENT_BYTES,
    SHARED_MEMORY_FORMAT,
    init_process_group_like_sglang,
    serialize_named_tensors,
    shared_memory_available,
    stage_named_tensors,
)

GROUP_NAME = "slime_weight_update"

Bucket = list[tuple[str, torch.Tensor]]


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


def bucket_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], buffer_size: int) -> Iterator[Bucket]:
    """Group (HF name, tensor) pairs, in order, into buckets of at most `buffer_size` bytes.

    Args:
        named_tensors: Full tensors under their HF names, ready to send (contiguous, final dtype).
        buffer_size: Bucket byte limit (`--update-weight-buffer-size`); a larger single tensor goes alone.

    Yields:
        Lists of (name, tensor).
    """
    bucket: Bucket = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > buffer_size:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
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
    return [
        dist.new_group(list(range(start, start + gpus_per_engine)), backend="gloo")
        for start in range(0, world_size, gpus_per_engine)
    ]


def send_buckets_as_tensors(
    buckets: Iterable[Bucket],
    engines: list,
    rank: int,
    gpus_per_engine: int,
    span_groups: list[dist.ProcessGroup | None],
    weight_version: str,
) -> None:
    """Colocated update: every rank consumes every bucket; the first rank of each engine's span posts.

    CPU tensors (the CPU engine, one process whatever its span): the first rank of the span asks the engine
    which segments its weights live in (an update of no tensors), then copies each bucket, in chunks of at
    most `SEGMENT_BYTES`, into shared-memory segments it keeps for later pushes and that are not among those
    (`stage_named_tensors`); it posts each chunk from a background thread while it copies the next one, and
    the engine's weights then live in those segments. CUDA tensors (or no /dev/shm): every rank of the span
    serializes its copy of the bucket (`serialize_named_tensors`) and the first one posts one payload per
    engine TP rank, as SGLang expects.

    Args:
        buckets: HF-named tensor buckets (every rank iterates them to the end: producing them is a collective).
        engines: One handle per colocated engine, engine `e` on ranks `[e * g, (e + 1) * g)`.
        rank: This training rank.
        gpus_per_engine: `g`, the engine's TP size.
        span_groups: From `engine_span_groups`.
        weight_version: Label the engines report afterwards.
    """
    engine_index = rank // gpus_per_engine
    engine = engines[engine_index] if engine_index < len(engines) else None
    span_start = engine_index * gpus_per_engine
    post = functools.partial(
        call_engine, engine, "update_weights_from_tensor", flush_cache=False, weight_version=weight_version
    )
    held: set[str] | None = None  # segments the engine's weights live in when the push starts
    posts: deque[Future] = deque()  # in flight, oldest first
    chunks = 0
    # One poster thread: chunks reach the engine in order, one request at a time.
    with ThreadPoolExecutor(max_workers=1) as poster:
        for bucket in buckets:
            if engine is None:
                continue
            if any(tensor.is_cuda for _, tensor in bucket) or not shared_memory_available():
                payload = serialize_named_tensors(bucket)
                if gpus_per_engine == 1:
                    payloads = [payload]
                else:
                    payloads = [None] * gpus_per_engine if rank == span_start else None
                    dist.gather_object(payload, payloads, dst=span_start, group=span_groups[engine_index])
                if rank == span_start:
                    post(serialized_named_tensors=payloads)
                continue
            if rank != span_start:
                continue
            if held is None:  # an update of no tensors: which segments do the engine's weights live in?
                held = set(post(serialized_named_tensors=[], load_format=SHARED_MEMORY_FORMAT)["segments_in_use"])
            for chunk in bucket_named_tensors(bucket, SEGMENT_BYTES):
                if len(posts) == 2:  # stop early on a refused chunk
                    posts.popleft().result()
                payload = stage_named_tensors(chunk, chunks, held)
                posts.append(poster.submit(post, serialized_named_tensors=[payload], load_format=SHARED_MEMORY_FORMAT))
                chunks += 1
        while posts:
            posts.popleft().result()


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
    backend = "nccl" if engine_kind == "sglang" and cuda_available() else "gloo"
    port = find_free_port(master_address)
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
    buckets: Iterable[Bucket], engines: list, group: BroadcastGroup | None, weight_version: str
) -> None:
    """Disaggregated update: every rank consumes every bucket; rank 0 (holding `group`) sends them.

    Args:
        buckets: HF-named tensor buckets (every rank iterates them to the end).
        engines: Engine handles (used on rank 0 only).
        group: From `connect_broadcast_group` on rank 0; None on the other ranks.
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


# ---------------------------------------------------------------------------------------------
# Any engine that reads a shared folder: HF safetensors on disk
# ---------------------------------------------------------------------------------------------

DISK_FLAG = "--update-weight-disk-dir"
FOLDER_KIND = "weight-sync"
# Files of --hf-checkpoint that hold weights (the push brings its own); every other top-level file is copied.
_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|gguf|h5|msgpack|onnx|npz)$|\.index\.json$")
# `.<push folder>.slime-tmp-<pid>`: the staging folder of an interrupted push.
_PUSH_STAGING = re.compile(r"^\.(weights-v.+-[0-9a-f]{8})\.slime-tmp-\d+$")


@dataclass
class DiskTarget:
    """Training rank 0's side of disk weight sync.

    Attributes:
        root: `--update-weight-disk-dir`; every push is a new folder in it.
        hf_checkpoint: `--hf-checkpoint`, whose config and tokenizer files each push copies.
        keep_files: `--update-weight-disk-keep-files`: never delete a push's folder.
        post_write: `--custom-update-weight-post-write-path` bound to args: f(folder, engines), or None.
        pushed: Folders written by this trainer and not deleted yet, oldest first.
    """

    root: Path
    hf_checkpoint: Path
    keep_files: bool = False
    post_write: Callable[[str, list], Any] | None = None
    pushed: list[Path] = field(default_factory=list)


def prepare_disk_target(args: Namespace) -> DiskTarget:
    """Check that this process can write `--update-weight-disk-dir` (creating it) and copy from `--hf-checkpoint`.

    Also removes the staging folders of pushes an earlier, killed trainer left there (slime-marked ones only).

    Raises:
        ValueError: naming the flag at fault and the fix.
    """
    root = Path(args.update_weight_disk_dir).absolute()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".slime-write-check-"):
            pass
    except OSError as error:
        raise ValueError(
            f"{DISK_FLAG} {root}: the trainer cannot write there ({type(error).__name__}: {error}); pass a folder "
            "that training rank 0 can write and every engine can read at the same path"
        ) from None
    hf_checkpoint = Path(args.hf_checkpoint)
    if not (hf_checkpoint / "config.json").is_file():
        raise ValueError(
            f"--update-weight-transport disk copies config and tokenizer files from --hf-checkpoint, but "
            f"{hf_checkpoint} is not a local HF folder with a config.json; download the model and pass its folder"
        )
    for entry in root.iterdir():
        match = _PUSH_STAGING.match(entry.name)
        if match:
            atomic_dir.remove_leftovers(root / match.group(1))
    hook = getattr(args, "custom_update_weight_post_write_path", None)
    return DiskTarget(
        root,
        hf_checkpoint.absolute(),
        keep_files=bool(getattr(args, "update_weight_disk_keep_files", False)),
        post_write=functools.partial(load_function(hook), args) if hook else None,
    )


def _copy_model_files(hf_checkpoint: Path, folder: Path) -> None:
    """Config, generation config, tokenizer, chat template...: every top-level file that holds no weights."""
    for entry in hf_checkpoint.iterdir():
        if entry.is_file() and not entry.name.startswith(".") and not _WEIGHT_FILE.search(entry.name):
            shutil.copyfile(entry, folder / entry.name)


def _write_shards(buckets: Iterable[Bucket], folder: Path) -> tuple[list[list[str]], int]:
    """One `shard-<i>.safetensors` per bucket; every bucket is consumed even after a write failed (the other
    training ranks are still producing them, a collective), then the write's OSError is raised."""
    shards: list[list[str]] = []
    nbytes, error = 0, None
    for bucket in buckets:
        if error is not None:
            continue
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in bucket}
        try:
            save_file(tensors, folder / f"shard-{len(shards):05d}.safetensors", metadata={"format": "pt"})
        except OSError as e:
            error = e
            continue
        shards.append(list(tensors))
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
    if error is not None:
        raise error
    return shards, nbytes


def write_weight_folder(buckets: Iterable[Bucket], disk: DiskTarget, weight_version: str) -> tuple[Path, int]:
    """Write one push: a HF folder with one safetensors shard per bucket, staged beside it and renamed into place.

    Args:
        buckets: HF-named tensor buckets (each at most `--update-weight-buffer-size` bytes but for one large tensor).
        disk: From `prepare_disk_target`.
        weight_version: Goes into the folder name, `weights-v<version>-<random>`.

    Returns:
        (the published folder, bytes of tensors written).

    Raises:
        OSError: the disk refused a write (full, removed, read-only), naming `--update-weight-disk-dir`; the
            staging folder is removed.
    """
    final = disk.root / f"weights-v{weight_version}-{uuid.uuid4().hex[:8]}"
    staging = atomic_dir.create_staging(final, FOLDER_KIND, DISK_FLAG)
    try:
        shards, nbytes = _write_shards(buckets, staging)
        if not shards:
            raise ValueError("the trainer produced no weights to write")
        if len(shards) == 1:
            names = ["model.safetensors"]
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            weight_map = {tensor: name for shard, name in zip(shards, names, strict=True) for tensor in shard}
            index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for i, name in enumerate(names):
            os.replace(staging / f"shard-{i:05d}.safetensors", staging / name)
        _copy_model_files(disk.hf_checkpoint, staging)
        atomic_dir.publish(staging, final, FOLDER_KIND, DISK_FLAG)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise OSError(f"{DISK_FLAG} {disk.root}: writing weight version {weight_version} failed: {e}") from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, nbytes


def load_weight_folder(engines: list, disk: DiskTarget, folder: Path, weight_version: str) -> None:
    """Have every engine load `folder` (`/update_weights_from_disk`), then delete the older pushes.

    A folder stays in `disk.pushed` until a later push has been loaded by every engine: an engine that
    failed to load this one may still hold an older one, and one that loaded it may reload it.
    """
    disk.pushed.append(folder)
    call_engines(engines, "update_weights_from_disk", model_path=str(folder), weight_version=weight_version)
    if disk.keep_files:
        return
    for old in disk.pushed[:-1]:
        if atomic_dir.is_slime_folder(old):  # never delete what slime did not write
            shutil.rmtree(old, ignore_errors=True)
    disk.pushed = [folder]


def send_buckets_by_disk(
    buckets: Iterable[Bucket], engines: list, disk: DiskTarget | None, rank: int, weight_version: str
) -> None:
    """Disk update: rank 0 writes the folder (the others only produce the buckets with it), runs the
    post-write hook, then pauses the engines just for loading it.

    Args:
        buckets: HF-named tensor buckets (every rank iterates them to the end).
        engines: Engine handles (used on rank 0 only).
        disk: From `prepare_disk_target` on rank 0; None on the other ranks.
        rank: This training rank.
        weight_version: Label the engines report afterwards.
    """
    if rank != 0 or disk is None:
        for _ in buckets:
            pass
        return
    folder, _ = write_weight_folder(buckets, disk, weight_version)
    if disk.post_write is not None:
        disk.post_write(str(folder), engines)
    call_engines(engines, "pause_generation")
    try:
        call_engines(engines, "flush_cache")
        load_weight_folder(engines, disk, folder, weight_version)
    except BaseException:
        _resume_quietly(engines)
        raise
    call_engines(engines, "continue_generation")


# ---------------------------------------------------------------------------------------------
# The actors' protocol around either transport
# ---------------------------------------------------------------------------------------------


@dataclass
class EngineLinks:
    """What a training rank keeps to update its engines.

    Attributes:
        engines: Engine handles.
        colocate: `--colocate`: shared-memory tensors; else broadcast from rank 0 (or disk, with `by_disk`).
        gpus_per_engine: `--rollout-num-gpus-per-engine`.
        span_groups: Colocated: from `engine_span_groups` (every rank); else empty.
        broadcast_group: Disaggregated: from `connect_broadcast_group` on rank 0; else None.
        by_disk: `--update-weight-transport disk` (every rank).
        disk: Disk: from `prepare_disk_target` on rank 0; else None.
    """

    engines: list
    colocate: bool
    gpus_per_engine: int
    span_groups: list
    broadcast_group: BroadcastGroup | None
    by_disk: bool = False
    disk: DiskTarget | None = None


def connect_engines(
    args: Namespace,
    engines: list,
    engine_urls: list[str],
    rank: int,
    world_size: int,
    previous: EngineLinks | None = None,
) -> EngineLinks:
    """Prepare this rank for weight updates (a collective when colocated: every rank calls it).

    Args:
        args: Needs `colocate`, `rollout_num_gpus_per_engine`, `rollout_backend`, `update_weight_transport`
            (disk: `update_weight_disk_dir`, `update_weight_disk_keep_files`, `hf_checkpoint`).
        engines: Engine handles (RolloutEngine Ray actors, or clients with the same methods).
        engine_urls: Their base URLs: engines all on localhost reach rank 0 at 127.0.0.1, else at this node's IP
            (on a multi-node cluster, where engines listen on their nodes' IPs).
        rank: This training rank.
        world_size: Number of training ranks.
        previous: The links this rank had before (reconnecting to restarted engines): disk sync goes on
            deleting the folders pushed through them.

    Returns:
        The links to pass to `update_engine_weights`.

    Raises:
        ValueError: disk, on rank 0: `--update-weight-disk-dir` is not writable or `--hf-checkpoint` not a folder.
    """
    gpus_per_engine = args.rollout_num_gpus_per_engine
    links = EngineLinks(list(engines), bool(args.colocate), gpus_per_engine, [], None)
    if links.colocate:
        links.span_groups = engine_span_groups(world_size, gpus_per_engine)
    elif getattr(args, "update_weight_transport", "nccl") == "disk":
        links.by_disk = True
        if rank == 0:
            kept = previous.disk if previous is not None else None
            links.disk = kept if kept is not None else prepare_disk_target(args)
    elif rank == 0 and links.engines:
        # Engines listen on 127.0.0.1 only on a one-node cluster (`PlacementSlice.host`), on their node's IP otherwise.
        local = all(urlparse(url).hostname in ("127.0.0.1", "localhost") for url in engine_urls)
        address = "127.0.0.1" if local else ray.util.get_node_ip_address()
        kind = getattr(args, "rollout_backend", "sglang")
        links.broadcast_group = connect_broadcast_group(links.engines, gpus_per_engine, address, kind)
    return links


def update_engine_weights(links: EngineLinks, buckets: Iterable[Bucket], rank: int, version: str) -> None:
    """Pause and flush the engines, send every bucket, resume them (every training rank calls this).

    Disk: rank 0 writes the folder first and pauses the engines only while they load it (`send_buckets_by_disk`).

    Args:
        links: From `connect_engines`.
        buckets: HF-named tensor buckets of the current weights (lazy: produced while sending).
        rank: This training rank.
        version: The weight version the engines report afterwards.
    """
    if links.by_disk:
        error = None
        try:
            send_buckets_by_disk(buckets, links.engines, links.disk, rank, version)
        except Exception as e:  # noqa: BLE001 - raised after the barrier, which the other ranks wait in
            error = e
        dist.barrier()
        if error is not None:
            raise error
        return
    try:
        if rank == 0:
            call_engines(links.engines, "pause_generation")
            call_engines(links.engines, "flush_cache")
        dist.barrier()
        if links.colocate:
            send_buckets_as_tensors(buckets, links.engines, rank, links.gpus_per_engine, links.span_groups, version)
        else:
            send_buckets_by_broadcast(buckets, links.engines, links.broadcast_group, version)
        dist.barrier()
    except BaseException:
        if rank == 0:
            _resume_quietly(links.engines)
        raise
    if rank == 0:
        call_engines(links.engines, "continue_generation")


def _resume_quietly(engines: list) -> None:
    """After a failed update: resume every engine that still answers, so none is left paused (the caller
    reports the update's error)."""
    for engine in engines:
        with contextlib.suppress(Exception):
            call_engine(engine, "continue_generation")


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


def weight_check_tolerance() -> float:
    """Largest |trainer - engine| probe log-prob gap accepted after a weight update.

    fp32 CPU engines agree to ~1e-5; bf16 GPU engines differ by up to ~0.1 even with identical weights.
    """
    return 0.1 if cuda_available() else 1e-3


def check_engines_match(engines: list, probe: list[int], trainer_log_probs: torch.Tensor, weight_version: Any) -> float:
    """Largest gap between each engine's log-probs of `probe` and the trainer's.

    Raises:
        RuntimeError: when the gap exceeds `weight_check_tolerance()`, naming the update.
    """
    gap = 0.0
    for engine in engines:
        engine_log_probs = torch.tensor(engine_prompt_log_probs(engine, probe), dtype=torch.float32)
        gap = max(gap, float((engine_log_probs - trainer_log_probs).abs().max()))
    tolerance = weight_check_tolerance()
    if gap > tolerance:
        raise RuntimeError(
            f"engine weights differ from the trainer's after update {weight_version}: probe log-probs "
            f"differ by up to {gap:.3g} (tolerance {tolerance}); check parameter names and dtypes"
        )
    return gap
