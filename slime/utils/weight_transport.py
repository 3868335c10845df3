"""How weights travel from a trainer to the inference engines; shared by both sides.

Senders are the trainers (FSDP, Megatron), receivers are the engines (SGLang, or slime's CPU
engine, which follows SGLang's conventions so a trainer never needs to know which one it talks to).

- Same host (`/update_weights_from_tensor`): `serialize_named_tensors` pickles (name, tensor)
  pairs with torch's shared-memory reductions and base64-encodes them, the form SGLang's
  `MultiprocessingSerializer` produces for `serialized_named_tensors`. CPU tensors go through
  named shared memory under torch's `file_system` sharing strategy: the default
  `file_descriptor` strategy passes descriptors over a socket that only a parent and the
  children it forked share, while a named segment can be opened by any process on the host.
  CUDA tensors travel as CUDA IPC handles. `deserialize_named_tensors` maps the segments.
  The payload is a pickle: accept it only from a trusted trainer.
- Any host (`/init_weights_update_group` + `/update_weights_from_distributed`): trainer rank 0
  and every engine rank call `init_process_group_like_sglang` with the same address, port and
  group name, forming a small world of their own next to (not inside) any default process
  group, then rank 0 broadcasts each tensor with `torch.distributed.broadcast(t, src=0, group=g)`.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import io
import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.distributed.distributed_c10d import _new_process_group_helper, _world


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Base64 pickle of (name, tensor) pairs whose storage another process on this host can map.

    CPU tensors are copied into fresh shared-memory segments first, so the receiver never
    aliases live trainer memory; CUDA tensors are sent as IPC handles of their storage. Pickling
    takes a reference on each CPU segment that the receiver drops once it has mapped it, so the
    caller may free its copies right away.

    Args:
        named_tensors: (HF parameter name, tensor) pairs.

    Returns:
        One element of `serialized_named_tensors` for `/update_weights_from_tensor`.
    """
    shareable = [
        (name, tensor if tensor.is_cuda else tensor.detach().clone(memory_format=torch.contiguous_format))
        for name, tensor in named_tensors
    ]
    buffer = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(shareable)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`: map the shared segments (no copy is made).

    Args:
        payload: One element of `serialized_named_tensors`.

    Returns:
        The (name, tensor) pairs.

    Raises:
        ValueError: The payload is not base64, or does not hold a list of (name, tensor) pairs.
    """
    named_tensors = pickle.loads(base64.b64decode(payload, validate=True))
    if not isinstance(named_tensors, list) or not all(
        isinstance(item, tuple | list)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in named_tensors
    ):
        raise ValueError("the payload does not hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in named_tensors]


def init_process_group_like_sglang(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
) -> dist.ProcessGroup:
    """Join a weight-update process group the way SGLang's `init_custom_process_group` builds it.

    Ranks find each other through keys in a TCP store, so every member must lay out its keys
    identically: a `TCPStore` hosted by rank 0, wrapped in `PrefixStore(group_name, store)` and
    handed to torch's own group constructor (`_new_process_group_helper`, which adds the
    "<group_name>/<device>/" prefixes). The group is registered under `group_name` beside any
    default group (which may or may not exist) and never becomes the default group. Blocks until
    all `world_size` ranks have joined. With gloo and a loopback `master_address` every rank is on
    this host, so gloo listens on 127.0.0.1; otherwise on the address this host's name resolves to
    (set `GLOO_SOCKET_IFNAME` where that is unreachable).

    Args:
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        master_address: Host of rank 0, where the store listens; reachable by every rank.
        master_port: Port of that store.
        rank: This process's rank: 0 for the trainer, `rank_offset + tp_rank` for an engine.
        world_size: 1 (the trainer) + the number of engine ranks.
        group_name: Unique within each process until `dist.destroy_process_group(group)`.
        timeout: For joining and for each collective.

    Returns:
        The group; pass it to `torch.distributed.broadcast(tensor, src=0, group=group)`, and to
        `torch.distributed.destroy_process_group` to leave it.
    """
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    backend_options = None
    if backend == "gloo" and master_address in ("127.0.0.1", "localhost", "::1"):
        backend_options = dist.ProcessGroupGloo._Options()
        backend_options._timeout = timeout
        backend_options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=backend_options,
        timeout=timeout,
    )
    # Group rank == "global" rank inside this small world; collectives and destroy look this map up.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
