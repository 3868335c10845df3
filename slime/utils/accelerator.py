"""Upstream slime's device helpers (`slime.utils.accelerator`), over `slime.utils.device`: CUDA when this process
has a GPU, else the CPU, asked anew on every call.

Upstream also selects vendor backends (MUSA, SUPA, by `SLIME_ACCELERATOR`); slime runs on CUDA or the CPU only.
On the CPU the helpers answer what a host has: one device named "cpu", nothing to synchronize or free, no device
memory figures.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from slime.utils.device import cuda_available, default_device, distributed_backend


def device_type() -> str:
    """The device kind: "cuda" when this process has a GPU, else "cpu"."""
    return "cuda" if cuda_available() else "cpu"


def accelerator_module() -> Any:
    """`torch.cuda`, or `torch.cpu` (which has the same `synchronize`, `current_device`, `device_count`, ...)."""
    return torch.cuda if cuda_available() else torch.cpu


def current_device() -> int | str:
    """The current CUDA device index, or "cpu"."""
    return default_device().index if cuda_available() else "cpu"


def device_name(index: int | None = None) -> str:
    """The device's name: "cuda:<index>" (the current device when `index` is None), or "cpu"."""
    if not cuda_available():
        return "cpu"
    return f"cuda:{current_device() if index is None else index}"


def device(index: int | None = None) -> torch.device:
    """`torch.device(device_name(index))`."""
    return torch.device(device_name(index))


def device_count() -> int:
    """Visible CUDA devices, or 1 on the CPU."""
    return torch.cuda.device_count() if cuda_available() else 1


def set_device(index: int | str | torch.device) -> None:
    """Make `index` the current CUDA device (nothing to do on the CPU)."""
    if cuda_available():
        torch.cuda.set_device(index)


def synchronize(device_arg: int | str | torch.device | None = None) -> None:
    """Wait for the device's queued work (CPU work is never queued)."""
    if cuda_available():
        torch.cuda.synchronize(device_arg)


def current_stream(device_arg: int | str | torch.device | None = None) -> Any:
    """The current CUDA stream, or None on the CPU."""
    return torch.cuda.current_stream(device_arg) if cuda_available() else None


def empty_cache() -> None:
    """Return cached CUDA memory to the driver (no cache on the CPU)."""
    if cuda_available():
        torch.cuda.empty_cache()


def ipc_collect() -> None:
    """Free CUDA memory held for other processes' IPC handles (none on the CPU)."""
    if cuda_available():
        torch.cuda.ipc_collect()


def mem_get_info(device_arg: int | str | torch.device | None = None) -> tuple[int, int]:
    """(free, total) bytes of the CUDA device.

    Raises:
        RuntimeError: On the CPU, where there is no device memory to report.
    """
    if not cuda_available():
        raise RuntimeError("mem_get_info: there is no accelerator memory on the CPU; read host memory with psutil")
    return torch.cuda.mem_get_info(current_device() if device_arg is None else device_arg)


def memory_allocated(device_arg: int | str | torch.device | None = None) -> int:
    """Bytes of CUDA memory held by tensors; 0 on the CPU."""
    return torch.cuda.memory_allocated(device_arg) if cuda_available() else 0


def memory_reserved(device_arg: int | str | torch.device | None = None) -> int:
    """Bytes of CUDA memory held by the caching allocator; 0 on the CPU."""
    return torch.cuda.memory_reserved(device_arg) if cuda_available() else 0


def get_device_properties(device_arg: int | str | torch.device | None = None) -> Any:
    """The CUDA device's properties (name, total_memory, ...), or None on the CPU."""
    if not cuda_available():
        return None
    return torch.cuda.get_device_properties(current_device() if device_arg is None else device_arg)


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (the CPU generator on the CPU)."""
    if cuda_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator (the CPU generator on the CPU)."""
    if cuda_available():
        torch.cuda.manual_seed_all(seed)
    else:
        torch.manual_seed(seed)


def visible_devices_env_key() -> str:
    """The environment variable that lists the visible devices: CUDA_VISIBLE_DEVICES."""
    return "CUDA_VISIBLE_DEVICES"


def resolve_visible_device_id(physical_device_id: int | float | str) -> int:
    """The index this process uses for physical device `physical_device_id` (Ray reports physical ids).

    Under `CUDA_VISIBLE_DEVICES=2,3` physical 3 is local 1; an id that is already local (0..count-1) is kept.

    Raises:
        RuntimeError: The id is neither visible nor a local index.
    """
    key = visible_devices_env_key()
    physical = int(float(physical_device_id))
    visible_text = os.environ.get(key)
    if not visible_text:
        return physical
    visible = [int(item) for item in visible_text.split(",") if item.strip()]
    if physical in visible:
        return visible.index(physical)
    if 0 <= physical < len(visible):
        return physical
    raise RuntimeError(
        f"device id {physical} is not visible under {key}={visible_text}: expected one of {visible} (physical) "
        f"or 0..{len(visible) - 1} (local)"
    )


def process_group_backend(default: str = "nccl") -> str:
    """The torch.distributed backend for `default`: "nccl" becomes gloo on the CPU; any other is kept."""
    return distributed_backend() if default == "nccl" else default


def weight_update_backend(default: str = "nccl") -> str:
    """The backend of the trainer-to-engine weight broadcast group; as `process_group_backend`."""
    return process_group_backend(default)
