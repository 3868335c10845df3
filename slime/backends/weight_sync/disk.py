"""Engines that read a folder the trainer writes: each push is a HF safetensors folder under
`--update-weight-disk-dir` (`--update-weight-transport disk`).

Training rank 0 writes the buckets as shards into a fresh folder (config and tokenizer files copied from
`--hf-checkpoint`, so `from_pretrained` of it works), renames it into place, runs
`--custom-update-weight-post-write-path`, and every engine loads it with `/update_weights_from_disk`; the
engines pause only for loading. The previous push's folder is deleted once the engines hold the new one
(unless `--update-weight-disk-keep-files`). For engines that cannot reach the trainer but read a folder it
writes (e.g. `--rollout-external-engine-addrs` on another network).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
import uuid
from argparse import Namespace
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from slime.backends.weight_sync.base import WeightTransport, call_engines
from slime.utils import atomic_dir
from slime.utils.misc import load_function
from slime.utils.weight_sync import Bucket

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
    if disk.keep_files:
        return
    for old in disk.pushed[:-1]:
        if atomic_dir.is_slime_folder(old):  # never delete what slime did not write
            shutil.rmtree(old, ignore_errors=True)
    disk.pushed = [folder]


class DiskTransport(WeightTransport):
    """Rank 0 writes each push's folder in `stage` (the other ranks only produce the buckets with it, and the
    engines keep serving), then has the engines load it in `push`.

    Args:
        args: Needs `update_weight_disk_dir`, `update_weight_disk_keep_files`, `hf_checkpoint`,
            `custom_update_weight_post_write_path`.
        target: The target of an earlier connection (reconnecting to restarted engines): go on deleting the
            folders pushed through it instead of preparing a new one.
    """

    staged = True

    def __init__(self, args: Namespace, target: DiskTarget | None = None):
        self.args = args
        self.target = target

    def connect(self, engines: list, engine_urls: list[str], rank: int, world_size: int) -> None:
        """On rank 0, check `--update-weight-disk-dir` (raises ValueError naming the flag) unless reconnecting."""
        super().connect(engines, engine_urls, rank, world_size)
        if rank == 0 and self.target is None:
            self.target = prepare_disk_target(self.args)

    def stage(self, buckets: Iterable[Bucket], version: str) -> Path | None:
        """Write the folder (rank 0) and run the post-write hook; return the folder (None on the other ranks)."""
        if self.rank != 0:
            for _ in buckets:
                pass
            return None
        folder, _ = write_weight_folder(buckets, self.target, version)
        if self.target.post_write is not None:
            self.target.post_write(str(folder), self.engines)
        return folder

    def push(self, buckets: Path, version: str) -> None:
        load_weight_folder(self.engines, self.target, buckets, version)
