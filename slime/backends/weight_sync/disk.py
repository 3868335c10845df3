"""Engines that read a folder the trainer writes: each push is a HF safetensors folder under
`--update-weight-disk-dir` (`--update-weight-transport disk`).

Training rank 0 writes the buckets as shards into a fresh folder (config and tokenizer files copied from
`--hf-checkpoint`, so `from_pretrained` of it works), renames it into place, runs
`--custom-update-weight-post-write-path`, and every engine loads it with `/update_weights_from_disk`; the
engines pause only for loading. The previous push's folder is deleted once the engines hold the new one
(unless `--update-weight-disk-keep-files`). For engines that cannot reach the trainer but read a folder it
writes (e.g. `--rollout-external-engine-addrs` on another network).

With `--update-weight-mode delta` a push after the first writes only what changed since the version the engines
hold (`slime.utils.weight_delta`: `--update-weight-delta-encoding`, `--update-weight-delta-checksum`) into a
`weights-v<version>-delta-<random>` folder; rank 0 keeps that base (`DeltaBase`). The first push of a connection
(a new trainer, restarted engines) is full, and so is one after a failed push; a delta an engine refuses (base
version or checksum mismatch) is followed at once, in the same pause, by the full weights. The log says why.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from argparse import Namespace
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import torch
from safetensors.torch import load_file, save_file

from slime.backends.weight_sync.base import WeightTransport, call_engines
from slime.utils import atomic_dir, weight_delta
from slime.utils.misc import load_function
from slime.utils.weight_sync import Bucket, bucket_named_tensors

logger = logging.getLogger(__name__)

DISK_FLAG = "--update-weight-disk-dir"
FOLDER_KIND = "weight-sync"
# Files of --hf-checkpoint that hold weights (the push brings its own); every other top-level file is copied.
_WEIGHT_FILE = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|gguf|h5|msgpack|onnx|npz)$|\.index\.json$")
# `.<push folder>.slime-tmp-<pid>`: the staging folder of an interrupted push.
_PUSH_STAGING = re.compile(r"^\.(weights-v.+-[0-9a-f]{8})\.slime-tmp-\d+$")
LOCAL_CHECKPOINT_FLAG = "--update-weight-local-checkpoint-dir"
BASE_KIND = "delta-base"


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
    hook = args.custom_update_weight_post_write_path
    return DiskTarget(
        root,
        hf_checkpoint.absolute(),
        keep_files=args.update_weight_disk_keep_files,
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
    drop_older_pushes(disk, [folder])


def drop_older_pushes(disk: DiskTarget, current: list[Path]) -> None:
    """Once every engine holds the `current` push's folders, delete the others `disk.pushed` lists (slime-marked ones
    only), unless `--update-weight-disk-keep-files`."""
    if disk.keep_files:
        return
    for old in disk.pushed:
        if old not in current and atomic_dir.is_slime_folder(old):  # never delete what slime did not write
            shutil.rmtree(old, ignore_errors=True)
    disk.pushed = [folder for folder in disk.pushed if folder in current]


class DeltaBase:
    """Training rank 0's copy of the weights the engines hold, which delta pushes are encoded against.

    Kept in memory (CPU tensors: one more copy of the pushed weights) or, with
    `--update-weight-local-checkpoint-dir DIR`, on disk as one safetensors file per tensor in `DIR/slime-delta-base`
    (one tensor in memory at a time). A push's new tensors wait as pending until the engines confirm it (`commit`).
    The copy never outlives the trainer process: a new trainer starts with a full push and clears the folder.

    Args:
        folder: `--update-weight-local-checkpoint-dir`, or None to keep the base in memory.

    Attributes:
        version: The weight version the engines confirmed holding the base; None while the next push must be full.
        reason: Why the next push is full (it goes into the log).
    """

    def __init__(self, folder: str | None, reason: str):
        self.version: str | None = None
        self.reason = reason
        self.order: dict[str, int] = {}  # tensor name -> its index (file name on disk), in push order
        self.tensors: dict[str, torch.Tensor] = {}  # in memory: the base
        self.pending: dict[str, torch.Tensor | Path] = {}
        self.folder = None if folder is None else _fresh_base_folder(Path(folder))

    def get(self, name: str) -> torch.Tensor | None:
        """The base tensor of `name` (None if no push held it yet)."""
        if self.folder is None or name not in self.order:
            return self.tensors.get(name)
        file = self.folder / "base" / f"{self.order[name]:06d}.safetensors"
        return load_file(file)["tensor"] if file.is_file() else None

    def hold(self, name: str, tensor: torch.Tensor) -> None:
        """Keep `tensor` as the pending base of `name` (a copy: bucket tensors may be views of live parameters)."""
        index = self.order.setdefault(name, len(self.order))
        if self.folder is None:
            self.pending[name] = tensor.detach().cpu().clone()
            return
        file = self.folder / "pending" / f"{index:06d}.safetensors"
        save_file({"tensor": tensor.detach().cpu().contiguous()}, file)
        self.pending[name] = file

    def commit(self, version: str) -> None:
        """The engines hold `version`: the pending tensors become the base."""
        for name, held in self.pending.items():
            if self.folder is None:
                self.tensors[name] = held
            else:
                os.replace(held, self.folder / "base" / held.name)
        self.pending, self.version = {}, version

    def drop(self, reason: str) -> None:
        """Forget the pending tensors and make the next push full, for `reason`."""
        for held in self.pending.values():
            if isinstance(held, Path):
                held.unlink(missing_ok=True)
        self.pending, self.version, self.reason = {}, None, reason

    def merged(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every tensor as the push being made leaves it: the pending one, else the base (a full push's content)."""
        for name in self.order:
            held = self.pending.get(name)
            if held is None:
                yield name, self.get(name)
            else:
                yield name, load_file(held)["tensor"] if isinstance(held, Path) else held


def _fresh_base_folder(root: Path) -> Path:
    """`root/slime-delta-base` emptied (it belongs to this trainer from now on), with base/ and pending/ in it."""
    folder = root / "slime-delta-base"
    try:
        if folder.exists():
            if not atomic_dir.is_slime_folder(folder):
                raise ValueError(
                    f"{LOCAL_CHECKPOINT_FLAG} {root}: {folder} exists and was not written by slime; move it away or "
                    "pass another folder"
                )
            shutil.rmtree(folder)
        (folder / "base").mkdir(parents=True)
        (folder / "pending").mkdir()
        atomic_dir.write_marker(folder, BASE_KIND)
    except OSError as error:
        raise ValueError(
            f"{LOCAL_CHECKPOINT_FLAG} {root}: the trainer cannot write there ({error}); pass a folder on a local disk "
            "of training rank 0 with room for one copy of the weights, or drop the flag to keep it in memory"
        ) from None
    return folder


def write_delta_folder(
    buckets: Iterable[Bucket], disk: DiskTarget, base: DeltaBase, weight_version: str, encoding: str, checksum: str
) -> tuple[Path, int, int]:
    """Write one delta push: every tensor that differs from `base`, encoded (`weight_delta.encode_tensor`), in one
    `delta-<i>.safetensors` payload file per bucket, and the manifest; staged beside the folder and renamed into
    place. The new tensors are held as `base`'s pending ones.

    Returns:
        (the published folder, payload bytes written, bytes of the weights it stands for).

    Raises:
        ValueError: a tensor the base does not hold (the model's tensors changed between pushes).
        OSError: the disk refused a write, naming `--update-weight-disk-dir`; the staging folder is removed.
    """
    final = disk.root / f"weights-v{weight_version}-delta-{uuid.uuid4().hex[:8]}"
    staging = atomic_dir.create_staging(final, FOLDER_KIND, DISK_FLAG)
    entries: dict[str, dict] = {}
    payload_bytes = weight_bytes = unchanged = 0
    error: BaseException | None = None
    for index, bucket in enumerate(buckets):  # all are consumed even after a failure: the ranks produce them together
        if error is not None:
            continue
        try:
            payloads, file = {}, f"delta-{index:05d}.safetensors"
            for name, tensor in bucket:
                weight_bytes += tensor.numel() * tensor.element_size()
                held = base.get(name)
                if held is None:
                    raise ValueError(f"tensor {name} was not in the previous push, so it has no base to encode against")
                payload = weight_delta.encode_tensor(tensor, held, encoding)
                if payload is None:
                    unchanged += 1
                    continue
                new = tensor.detach().cpu()
                payloads[name] = np.frombuffer(payload, dtype=np.uint8)
                entries[name] = {
                    "file": file,
                    "dtype": weight_delta.dtype_name(new.dtype),
                    "shape": list(new.shape),
                    "checksum": weight_delta.checksum(weight_delta.raw_bytes(new), checksum),
                }
                base.hold(name, new)
            if payloads:
                safetensors.numpy.save_file(payloads, staging / file)
                payload_bytes += sum(p.size for p in payloads.values())
        except BaseException as e:  # noqa: BLE001 - raised once every bucket is consumed
            error = e
    try:
        if error is not None:
            raise error
        weight_delta.write_manifest(staging, base.version, weight_version, encoding, checksum, entries, unchanged)
        atomic_dir.publish(staging, final, FOLDER_KIND, DISK_FLAG)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise OSError(f"{DISK_FLAG} {disk.root}: writing delta version {weight_version} failed: {e}") from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, payload_bytes, weight_bytes


def _held(buckets: Iterable[Bucket], base: DeltaBase) -> Iterator[Bucket]:
    """The buckets, unchanged, each tensor also held as `base`'s pending one (a full push in delta mode)."""
    for bucket in buckets:
        for name, tensor in bucket:
            base.hold(name, tensor)
        yield bucket


class DiskTransport(WeightTransport):
    """Rank 0 writes each push's folder in `stage` (the other ranks only produce the buckets with it, and the
    engines keep serving), then has the engines load it in `push`.

    Args:
        args: Needs `update_weight_disk_dir`, `update_weight_disk_keep_files`, `hf_checkpoint`,
            `custom_update_weight_post_write_path`, `update_weight_mode`; delta also `update_weight_delta_encoding`,
            `update_weight_delta_checksum`, `update_weight_local_checkpoint_dir`, `update_weight_buffer_size`.
        target: The target of an earlier connection (reconnecting to restarted engines): go on deleting the
            folders pushed through it instead of preparing a new one.
    """

    staged = True

    def __init__(self, args: Namespace, target: DiskTarget | None = None):
        self.args = args
        self.target = target
        self.delta: DeltaBase | None = None  # rank 0 with --update-weight-mode delta
        self._staged_delta = False  # whether the staged folder is a delta

    def connect(self, engines: list, engine_urls: list[str], rank: int, world_size: int) -> None:
        """On rank 0, check `--update-weight-disk-dir` (raises ValueError naming the flag) unless reconnecting, and
        in delta mode start an empty base (`--update-weight-local-checkpoint-dir` is cleared): the next push is full."""
        super().connect(engines, engine_urls, rank, world_size)
        if rank != 0:
            return
        reconnecting = self.target is not None
        if self.target is None:
            self.target = prepare_disk_target(self.args)
        if self.args.update_weight_mode == "delta":
            reason = (
                "reconnected to the engines (a restarted engine holds its checkpoint's weights, not the last push)"
                if reconnecting
                else "first push of this trainer"
            )
            self.delta = DeltaBase(self.args.update_weight_local_checkpoint_dir, reason)

    def stage(self, buckets: Iterable[Bucket], version: str) -> Path | None:
        """Write the folder (rank 0; a delta when the engines hold a known base) and run the post-write hook; return
        the folder (None on the other ranks)."""
        if self.rank != 0:
            for _ in buckets:
                pass
            return None
        delta = self.delta
        self._staged_delta = delta is not None and delta.version is not None
        if delta is None:
            folder, _ = write_weight_folder(buckets, self.target, version)
        elif not self._staged_delta:
            logger.info("weight push v%s is full (--update-weight-mode delta): %s", version, delta.reason)
            try:
                folder, _ = write_weight_folder(_held(buckets, delta), self.target, version)
            except BaseException:
                delta.drop(delta.reason)
                raise
        else:
            encoding, checksum = self.args.update_weight_delta_encoding, self.args.update_weight_delta_checksum
            try:
                folder, written, total = write_delta_folder(buckets, self.target, delta, version, encoding, checksum)
            except BaseException as error:
                delta.drop(f"writing delta v{version} failed ({error})")
                raise
            logger.info(
                "weight push v%s is a delta against v%s: %d tensors changed, %.2f MB written for %.2f MB of weights "
                "(%s)",
                version,
                delta.version,
                len(delta.pending),
                written / 1e6,
                total / 1e6,
                encoding,
            )
        if self.target.post_write is not None:
            self.target.post_write(str(folder), self.engines)
        return folder

    def push(self, buckets: Path, version: str) -> None:
        """Have the engines load the folder; in delta mode, follow a refused delta with the full weights, and move
        the base on once the engines hold the push (after a failure the next push is full)."""
        if self.delta is None:
            load_weight_folder(self.engines, self.target, buckets, version)
            return
        try:
            try:
                load_weight_folder(self.engines, self.target, buckets, version)
            except Exception as error:
                if not self._staged_delta:
                    raise
                logger.warning(
                    "delta weight push v%s was refused (%s); pushing the full weights of v%s instead",
                    version,
                    error,
                    version,
                )
                full = bucket_named_tensors(self.delta.merged(), self.args.update_weight_buffer_size)
                folder, _ = write_weight_folder(full, self.target, version)
                if self.target.post_write is not None:
                    self.target.post_write(str(folder), self.engines)
                load_weight_folder(self.engines, self.target, folder, version)
        except BaseException as error:
            self.delta.drop(f"the previous push (v{version}) failed: {error}")
            raise
        self.delta.commit(version)
