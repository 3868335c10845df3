"""Release the memory behind tensors while the engines generate, and restore it bit for bit.

Both training backends call this from `offload()` / `onload()` under `--offload-train`. Each unique
storage behind the given tensors (many views share one: Megatron's DDP buffers back every parameter
and gradient) has its bytes copied out and is then resized to zero, which frees its memory; restoring
resizes it back and copies the bytes in. Views stay valid across this because a tensor holds its
storage object, not the storage's address. Anything that cached a raw address (CUDA graphs,
registered communication buffers) would not survive it.

Where the bytes go: on CUDA to pinned host memory; on CPU to a file in a private temporary directory
(copying to RAM would free nothing there), removed on restore or at exit. Set `TMPDIR` to a disk
with room for the model and optimizer state; a tmpfs `/tmp` lives in RAM and frees nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class ReleasedStorages:
    """Storages freed by `release_storages`; `restore_storages` brings them back."""

    storages: list[torch.UntypedStorage] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    keep_contents: bool = True
    # CUDA: one pinned host copy per storage. CPU: one file holding all of them back to back.
    host_copies: list[torch.Tensor] = field(default_factory=list)
    backup_dir: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def _byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))


def _host_buffer(storage: torch.UntypedStorage, nbytes: int) -> memoryview:
    # A buffer over a CPU storage's bytes for file I/O. Not `.numpy()`: it makes the storage non-resizable.
    return memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")


def _transfer(io_call, buffer: memoryview) -> None:
    # Unbuffered file I/O may move fewer bytes than asked: loop until done.
    while buffer:
        done = io_call(buffer)
        if not done:
            raise OSError("offload backup file is truncated")
        buffer = buffer[done:]


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    storages, skip = [], set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in skip:
            continue
        skip.add(key)
        storages.append(storage)
    return storages


def _warn_if_in_ram(directory: str) -> None:
    # The longest mount point containing the directory gives its file system.
    best, fs_type = "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) > 2 and directory.startswith(parts[1].rstrip("/") + "/") and len(parts[1]) > len(best):
                    best, fs_type = parts[1], parts[2]
    except OSError:
        return
    if fs_type in ("tmpfs", "ramfs"):
        logger.warning(
            "offload backups go to %s, a %s in RAM: offloading frees no memory; set TMPDIR to a disk",
            directory,
            fs_type,
        )


def release_storages(tensors: Iterable[torch.Tensor], keep_contents: bool = True) -> ReleasedStorages:
    """Free the unique storages behind `tensors`, saving their bytes unless `keep_contents=False`.

    Args:
        tensors: any mix of parameters, buffers, views, gradients and optimizer state; storages shared by
            several of them are released once, storages already released (size 0) are skipped.
        keep_contents: False for gradients and other scratch memory: restored as zeros, nothing is copied.

    Raises:
        ValueError: a storage cannot be resized (memory-mapped, or shared with numpy); nothing is released.
        OSError: the backup file could not be written (disk full?); what was released is restored first.
    """
    released = ReleasedStorages(keep_contents=keep_contents)
    storages = _unique_storages(tensors)
    fixed = [storage for storage in storages if not storage.resizable()]
    if fixed:
        raise ValueError(
            f"cannot offload {len(fixed)} of {len(storages)} storages ({sum(s.nbytes() for s in fixed)} bytes): "
            "they are not resizable (memory-mapped, from_blob or shared with numpy); allocate them with torch"
        )
    backup = None
    try:
        if keep_contents and any(storage.device.type == "cpu" for storage in storages):
            released.backup_dir = tempfile.mkdtemp(prefix="slime-offload-")
            weakref.finalize(released, shutil.rmtree, released.backup_dir, ignore_errors=True)
            _warn_if_in_ram(os.path.realpath(released.backup_dir))
            # Unbuffered: a failed write leaves no buffered bytes behind to fail again on close.
            backup = open(os.path.join(released.backup_dir, "storages.bin"), "wb", buffering=0)
        for storage in storages:
            nbytes = storage.nbytes()
            if keep_contents and storage.device.type == "cpu":
                _transfer(backup.write, _host_buffer(storage, nbytes))
            elif keep_contents:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                host.copy_(_byte_view(storage, nbytes))
                released.host_copies.append(host)
            storage.resize_(0)
            released.storages.append(storage)
            released.sizes.append(nbytes)
    except OSError as error:
        directory = released.backup_dir or tempfile.gettempdir()
        if backup is not None:
            backup.close()
        elif released.backup_dir is not None:  # the file never opened: nothing was released
            shutil.rmtree(released.backup_dir, ignore_errors=True)
            released.backup_dir = None
        restore_storages(released)
        raise OSError(
            f"offloading {sum(s.nbytes() for s in storages)} bytes to {directory} failed ({error}); "
            "set TMPDIR to a disk with room for the model and optimizer state"
        ) from error
    if backup is not None:
        backup.close()
    return released


def restore_storages(released: ReleasedStorages) -> None:
    """Give every storage of `released` its size and bytes back (zeros when released without contents)."""
    backup = None
    if released.backup_dir is not None:
        backup = open(os.path.join(released.backup_dir, "storages.bin"), "rb", buffering=0)
    host_copies = iter(released.host_copies)
    with torch.no_grad():
        for storage, nbytes in zip(released.storages, released.sizes, strict=True):
            storage.resize_(nbytes)
            if not released.keep_contents:
                _byte_view(storage, nbytes).zero_()
            elif storage.device.type == "cpu":
                _transfer(backup.readinto, _host_buffer(storage, nbytes))
            else:
                _byte_view(storage, nbytes).copy_(next(host_copies))
    if backup is not None:
        backup.close()
        shutil.rmtree(released.backup_dir, ignore_errors=True)
    released.storages, released.sizes, released.host_copies, released.backup_dir = [], [], [], None
