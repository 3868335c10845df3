"""How weights travel from a trainer to the inference engines; shared by both sides.

Senders are the trainers (FSDP, Megatron), receivers are the engines (SGLang, or slime's CPU
engine, which follows SGLang's conventions so a trainer never needs to know which one it talks to).

- Same host (`/update_weights_from_tensor`): `serialize_named_tensors` pickles (name, tensor)
  pairs with torch's shared-memory reductions and base64-encodes them, the form SGLang's
  `MultiprocessingSerializer` produces for `serialized_named_tensors`. CPU tensors go through
  named shared memory under torch's `file_system` sharing strategy: the default
  `file_descriptor` strategy passes descriptors over a socket that only a parent and the
  children it forked share, while a named segment can be opened by any process on the host.
  CUDA tensors travel as CUDA IPC handles. `deserialize_named_tensors` maps the segments. The
  payload is a pickle, so it is read by a restricted unpickler that resolves only the few torch
  rebuild functions and types `serialize_named_tensors` writes (`ALLOWED_PICKLE_GLOBALS`) and
  refuses any other global before building anything. Mapping a handle still trusts the sender
  with memory on this host: keep engines on loopback or behind an API key.
- Any host (`/init_weights_update_group` + `/update_weights_from_distributed`): trainer rank 0
  and every engine rank call `init_process_group_like_sglang` with the same address, port and
  group name, forming a small world of their own next to (not inside) any default process
  group, then rank 0 broadcasts each tensor with `torch.distributed.broadcast(t, src=0, group=g)`.
"""

from __future__ import annotations

import base64
import binascii
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


# Every global a `serialize_named_tensors` payload names, found with `pickletools.dis` on real payloads
# (CPU tensors under the file_system strategy) and in torch.multiprocessing.reductions.reduce_tensor
# (CUDA tensors: rebuild_cuda_tensor with the tensor class, torch.Size, TypedStorage and a dtype). Lists,
# tuples, str, bytes, ints and bools are pickle opcodes, not globals, so no builtins are needed.
ALLOWED_PICKLE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
    }
    # A dtype pickles as the global torch.<name>, e.g. torch.bfloat16.
    | {("torch", str(value).removeprefix("torch.")) for value in vars(torch).values() if isinstance(value, torch.dtype)}
)


def _check_global(module: str, name: str) -> None:
    if (module, name) not in ALLOWED_PICKLE_GLOBALS:
        raise ValueError(
            f"the payload refers to {module}.{name}, which is not one of the torch tensor-rebuild globals that "
            "serialize_named_tensors writes; refusing to unpickle it (send payloads made by serialize_named_tensors)"
        )


class _Inert:
    """Stands in for every allowed global during the vetting pass, so that pass runs no torch code."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __setstate__(self, state):
        pass


class _VettingUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        _check_global(module, name)
        return _Inert


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        _check_global(module, name)  # exact (module, name) pairs: no dotted names such as "UntypedStorage.from_file"
        return super().find_class(module, name)


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`: map the shared segments (no copy is made).

    The pickle is read twice: first with every global replaced by an inert stand-in, which rejects
    any global outside `ALLOWED_PICKLE_GLOBALS` before a single object is built, then for real with
    the same allow-list.

    Args:
        payload: One element of `serialized_named_tensors`.

    Returns:
        The (name, tensor) pairs.

    Raises:
        ValueError: The payload is not base64, names a global outside the allow-list, is not a valid
            pickle, or does not hold a list of (name, tensor) pairs.
    """
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"the payload is not base64: {error}") from None
    for unpickler in (_VettingUnpickler, _TensorUnpickler):
        try:
            named_tensors = unpickler(io.BytesIO(raw)).load()
        except ValueError:
            raise
        except Exception as error:  # truncated or hand-made pickles fail in many ways
            raise ValueError(f"the payload is not a serialize_named_tensors pickle: {error!r}") from None
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
