"""How weights travel from a trainer to the inference engines; shared by both sides.

Senders are the trainers (FSDP, Megatron; their transports, which call the engines, are in
`slime.backends.weight_sync`), receivers are the engines (SGLang, or slime's CPU engine, which follows
SGLang's conventions so a trainer never needs to know which one it talks to). Nothing here calls an engine.

- Same host, CPU tensors (`/update_weights_from_tensor` with `load_format=SHARED_MEMORY_FORMAT`, the CPU
  engine): a trainer process keeps sealed memory files (memfd: anonymous, never a name in /dev/shm) for its
  whole life, two per chunk of a push. `stage_named_tensors` copies a chunk into one of them that the receiver
  does not hold (one memcpy per tensor; after the first pushes the pages are already mapped, so no page
  faults) and returns JSON naming the segment, the sender's pid and fd, and each tensor's dtype, shape and
  byte offset. The receiver opens each segment once through /proc/<pid>/fd/<fd> and maps it
  (`MappedSegments`), checks every name, dtype, shape and offset against it (`parse_shared_payload`,
  `MappedSegments.named_tensors`) and points its parameters of the same dtype at the views instead of copying;
  its answer lists the segments its weights live in (`MappedSegments.holding`). A push starts with an update
  of no tensors to learn that list and writes only segments outside it, so it costs one copy; the two
  segments of a chunk alternate while the engine keeps its weights in one of them (with --offload-rollout the
  engine reloads its weights into memory of its own before each push, and one set is reused). No pickle is
  involved. A segment's name carries the job's tag (`segment_tag`, from the engines' API key), and a
  receiver with a key maps only segments with its own tag; it maps only memory files of its own user that
  are sealed against shrinking and growing, so no one can cut a segment short under its weights (a SIGBUS).
  A segment's memory goes when the trainer closes it (or exits, or is killed) and no engine maps it any more:
  an engine keeps the ones its weights live in until the next push replaces them, and drops its other
  mappings of closed segments at its next push.
- Same host, CUDA tensors (SGLang): `serialize_named_tensors` pickles (name, tensor) pairs with torch's
  reductions and base64-encodes them, the form SGLang's `MultiprocessingSerializer` produces for
  `serialized_named_tensors`: CUDA tensors travel as CUDA IPC handles. CPU tensors (small pushes, tests,
  hosts without memfd) travel by value inside the pickle, never as the name of a file: torch's own
  file-system reduction would let a payload name any /dev/shm file, and a socket, for the receiver to open,
  grow and map. The payload is a pickle, so it is read by a restricted unpickler that resolves only the few
  globals `serialize_named_tensors` writes (`ALLOWED_PICKLE_GLOBALS`) and refuses any other before building
  anything. Mapping a CUDA handle still trusts the sender with memory on this host, which is why every
  engine slime starts requires the job's API key.
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
import fcntl
import hashlib
import io
import json
import math
import mmap
import os
import pickle
import re
import secrets
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.distributed.distributed_c10d import _new_process_group_helper, _world

# torch.<name> -> dtype, e.g. "bfloat16" -> torch.bfloat16.
_DTYPES = {str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, torch.dtype)}
_MAX_DIM = 2**40


def _tensor_from_bytes(data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
    """A CPU tensor `serialize_named_tensors` carried by value; checks that `data` holds exactly that tensor."""
    if not isinstance(data, bytes) or dtype not in _DTYPES or not isinstance(shape, list | tuple):
        raise ValueError(f"a by-value tensor needs bytes, a torch dtype name and a shape, got dtype {dtype!r}")
    if not all(_is_int(dim) and 0 <= dim <= _MAX_DIM for dim in shape):
        raise ValueError(f"a by-value tensor's shape must be non-negative integers, got {shape!r}")
    torch_dtype = _DTYPES[dtype]
    expected = math.prod(shape) * torch_dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"a {dtype} tensor of shape {list(shape)} is {expected} bytes, the payload holds {len(data)}")
    if expected == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).view(shape)  # bytearray: a writable copy


class _NamedTensorPickler(ForkingPickler):
    """torch's reductions for CUDA tensors (IPC handles); CPU tensors by value (`_tensor_from_bytes`)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and not obj.is_cuda:
            flat = obj.detach().contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return _tensor_from_bytes, (data, str(obj.dtype).removeprefix("torch."), list(obj.shape))
        return NotImplemented


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]], as_dict: bool = False) -> str:
    """Base64 pickle of (name, tensor) pairs for an engine on this host.

    CUDA tensors are sent as IPC handles of their storage (the receiver maps them; no copy); CPU tensors
    are copied into the payload, so the receiver never aliases trainer memory and the caller may free or
    change its tensors right away.

    Args:
        named_tensors: (HF parameter name, tensor) pairs.
        as_dict: Pickle a {name: tensor} dict, the form SGLang's `/load_lora_adapter_from_tensors` reads.

    Returns:
        One element of `serialized_named_tensors` for `/update_weights_from_tensor` (or, `as_dict`,
        `serialized_tensors` for `/load_lora_adapter_from_tensors`).
    """
    buffer = io.BytesIO()
    payload = dict(named_tensors) if as_dict else [(name, tensor) for name, tensor in named_tensors]
    _NamedTensorPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# Every global a `serialize_named_tensors` payload names: `_tensor_from_bytes` for CPU tensors, and what
# torch.multiprocessing.reductions.reduce_tensor writes for CUDA ones (rebuild_cuda_tensor with the tensor class,
# torch.Size, the storage class and a dtype). None of torch's CPU storage rebuilds is here: each opens a file or
# socket the payload names. Lists, tuples, str, bytes, ints and bools are pickle opcodes, not globals, so no
# builtins are needed.
ALLOWED_PICKLE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (__name__, "_tensor_from_bytes"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "Tensor"),
        ("torch.nn.parameter", "Parameter"),
        ("torch", "Size"),
    }
    # A dtype pickles as the global torch.<name>, e.g. torch.bfloat16.
    | {("torch", name) for name in _DTYPES}
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
    """Builds the tensors, at most `budget` bytes of them by value: a pickle can name one bytes object for many
    tensors, and each would be a copy of its own (a small payload growing into all of memory)."""

    def __init__(self, file, budget: int):
        super().__init__(file)
        self.budget = budget

    def find_class(self, module: str, name: str):
        _check_global(module, name)  # exact (module, name) pairs: no dotted names such as "UntypedStorage.from_file"
        if (module, name) == (__name__, "_tensor_from_bytes"):
            return self._tensor_within_budget
        return super().find_class(module, name)

    def _tensor_within_budget(self, data: bytes, dtype: str, shape: list[int]) -> torch.Tensor:
        self.budget -= len(data) if isinstance(data, bytes) else 0
        if self.budget < 0:
            raise ValueError("the payload's tensors hold more bytes than the payload itself (a bytes object reused)")
        return _tensor_from_bytes(data, dtype, shape)


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`: map the shared segments (no copy is made).

    The pickle is read twice: first with every global replaced by an inert stand-in, which rejects
    any global outside `ALLOWED_PICKLE_GLOBALS` before a single object is built, then for real with
    the same allow-list.

    Args:
        payload: One element of `serialized_named_tensors`.

    Returns:
        The (name, tensor) pairs (of a `serialize_named_tensors(..., as_dict=True)` dict too).

    Raises:
        ValueError: The payload is not base64, names a global outside the allow-list, is not a valid
            pickle, or does not hold a list of (name, tensor) pairs or a {name: tensor} dict.
    """
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"the payload is not base64: {error}") from None
    for unpickler in (_VettingUnpickler(io.BytesIO(raw)), _TensorUnpickler(io.BytesIO(raw), budget=len(raw))):
        try:
            named_tensors = unpickler.load()
        except ValueError:
            raise
        except Exception as error:  # truncated or hand-made pickles fail in many ways
            raise ValueError(f"the payload is not a serialize_named_tensors pickle: {error!r}") from None
    if isinstance(named_tensors, dict):
        named_tensors = list(named_tensors.items())
    if not isinstance(named_tensors, list) or not all(
        isinstance(item, tuple | list)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in named_tensors
    ):
        raise ValueError("the payload does not hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in named_tensors]


# ---------------------------------------------------------------------------------------------
# CPU tensors: persistent named segments described by JSON
# ---------------------------------------------------------------------------------------------

SHARED_MEMORY_FORMAT = "slime_shared_memory"  # load_format of /update_weights_from_tensor for these payloads
# Bytes per chunk, i.e. per request; a larger tensor goes alone and its segments grow to fit it.
SEGMENT_BYTES = 64 * 2**20
# Per chunk: one segment the receiver's weights may live in, one to fill with the next push.
_SEGMENTS_PER_CHUNK = 2
_ALIGN = 64  # every tensor starts at a multiple of this: aligned for any dtype, and for fast copies
# slime_w_<job tag>_<random>, or slime_w_<random> from a sender without a tag.
_SEGMENT_NAME = re.compile(r"slime_w_(?:[0-9a-f]{16}_)?[0-9a-f]{16}")
# A segment may neither shrink (a receiver reading past a shrunk end gets SIGBUS) nor grow, nor take other seals.
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def segment_tag(api_key: str | None) -> str | None:
    """The job's tag in its segment names: derived from the engines' API key, which sender and receiver both
    hold and no other job does (a hash: the names are public in /proc/<pid>/fd); None without a key."""
    if not api_key:
        return None
    return hashlib.sha256(b"slime weight segments\0" + api_key.encode()).hexdigest()[:16]


def _segment_prefix(tag: str | None) -> str:
    return f"slime_w_{tag}_" if tag else "slime_w_"


def shared_memory_available() -> bool:
    """Whether this host can share sealed memory files between processes (Linux: memfd_create and /proc)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _fd_path(pid: int, fd: int) -> str:
    return f"/proc/{pid}/fd/{fd}"


@dataclass
class _SendSegment:
    name: str
    fd: int  # open for the segment's life: a receiver opens the memory through /proc/<pid>/fd/<fd>
    data: torch.Tensor  # flat uint8 over a read-write mapping of the whole segment


_SEND_SEGMENTS: dict[int, list[_SendSegment]] = {}  # this process's segments, by chunk index


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _create_segment(nbytes: int, tag: str | None) -> _SendSegment:
    name = _segment_prefix(tag) + secrets.token_hex(8)
    # An anonymous memory file, never a name in /dev/shm: nothing outlives this process but the mappings of it,
    # /dev/shm's size does not bound it, and its seals make it impossible to shrink under a receiver.
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        # Reserve the pages now: running out is an error here instead of a SIGBUS in the copy.
        os.posix_fallocate(fd, 0, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        memory = mmap.mmap(fd, nbytes)
    except OSError as error:
        os.close(fd)
        raise RuntimeError(
            f"cannot reserve {nbytes / 2**20:.0f} MiB of shared memory for a colocated weight update: "
            f"{error.strerror}; give the trainer's host (or its container's memory limit) more room, or run the "
            "engines apart from the trainer (no --colocate)"
        ) from None
    return _SendSegment(name, fd, torch.frombuffer(memory, dtype=torch.uint8))


def _close(segment: _SendSegment) -> None:
    """Let go of the segment; its memory goes once no process maps it (ours goes with `segment.data`)."""
    with contextlib.suppress(OSError):
        os.close(segment.fd)


def release_send_segments() -> None:
    """Close this process's send segments; a later `stage_named_tensors` makes new ones. A receiver keeps the
    memory it still maps. (Exiting, or being killed, closes them too: they are memory files, not names.)"""
    while _SEND_SEGMENTS:
        for segment in _SEND_SEGMENTS.popitem()[1]:
            _close(segment)


@torch.no_grad()
def stage_named_tensors(
    named_tensors: list[tuple[str, torch.Tensor]], index: int, held: Collection[str] = (), tag: str | None = None
) -> str:
    """Copy (name, tensor) pairs into one of this process's two segments for chunk `index` and describe them.

    The segment is one not in `held`; it is created on first use, replaced by a larger one when the tensors
    do not fit, and kept for later pushes, so they write into pages that are already mapped. A held segment
    is never written (only closed when both are held, which leaves the receiver's memory alone).

    Args:
        named_tensors: (HF parameter name, tensor) pairs; any device, dtype and strides.
        index: The chunk's position in the push (0, 1, ...): each position has segments of its own.
        held: Names of the segments the receiver's weights live in: its answer `segments_in_use` to an update
            of no tensors sent before the push. Holds for one receiver per sending process.
        tag: The job's `segment_tag`, which a receiver with the same key requires in the segment's name.

    Returns:
        One element of `serialized_named_tensors` for `/update_weights_from_tensor` with
        `load_format=SHARED_MEMORY_FORMAT`: JSON {"segment", "pid", "fd", "tensors": [{"name", "dtype", "shape",
        "offset"}]}, where /proc/<pid>/fd/<fd> opens the segment.

    Raises:
        RuntimeError: the host has no memory left for the segment.
    """
    entries, end = [], 0
    for name, tensor in named_tensors:
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append({"name": name, "dtype": dtype, "shape": list(tensor.shape), "offset": end})
        end += _round_up(tensor.numel() * tensor.element_size(), _ALIGN)
    segments = _SEND_SEGMENTS.setdefault(index, [])
    prefix = _segment_prefix(tag)
    free = [segment for segment in segments if segment.name not in held and segment.name.startswith(prefix)]
    segment = next((segment for segment in free if segment.data.numel() >= end), None)
    if segment is None:
        if len(segments) == _SEGMENTS_PER_CHUNK:  # replace one that is too small, or else the oldest
            old = free[0] if free else segments[0]
            segments.remove(old)
            _close(old)
        segment = _create_segment(_round_up(max(end, 1), 2**20), tag)
        segments.append(segment)
    for (_, tensor), entry in zip(named_tensors, entries):
        start = entry["offset"]
        target = segment.data[start : start + tensor.numel() * tensor.element_size()]
        target.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return json.dumps({"segment": segment.name, "pid": os.getpid(), "fd": segment.fd, "tensors": entries})


@dataclass(frozen=True)
class SharedTensor:
    """One tensor of a `stage_named_tensors` payload: `math.prod(shape) * dtype.itemsize` bytes at `offset`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class SharedPayload:
    """A parsed `stage_named_tensors` payload: the segment's name, where its sender holds it, and its tensors."""

    segment: str
    pid: int
    fd: int
    tensors: list[SharedTensor]


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(index: int, entry: object) -> SharedTensor:
    where = f"tensors[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with name, dtype, shape and offset, got {_show(entry)}")
    name, dtype, shape, offset = (entry.get(key) for key in ("name", "dtype", "shape", "offset"))
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string, got {_show(name)}")
    where = f"{where} ({name[:80]})"
    if dtype not in _DTYPES:
        raise ValueError(f"{where}: dtype must name a torch dtype such as 'float32', got {_show(dtype)}")
    if not isinstance(shape, list) or not all(_is_int(size) and 0 <= size < _MAX_DIM for size in shape):
        raise ValueError(f"{where}: shape must be a list of integers in [0, 2**40), got {_show(shape)}")
    itemsize = _DTYPES[dtype].itemsize
    if not _is_int(offset) or offset < 0 or offset % itemsize:
        raise ValueError(f"{where}: offset must be a non-negative multiple of {itemsize}, got {_show(offset)}")
    return SharedTensor(name, _DTYPES[dtype], tuple(shape), offset)


def parse_shared_payload(payload: str, tag: str | None = None) -> SharedPayload:
    """Read and check one `stage_named_tensors` payload; opens and maps nothing yet (`MappedSegments`).

    Args:
        tag: The receiver's `segment_tag`: the segment must carry it. None accepts any slime segment name.

    Raises:
        ValueError: naming the first malformed part: not JSON, a segment name slime does not make (or without
            the job's tag), a pid or fd that is not a non-negative integer, or a tensor entry without a name, a
            known dtype, a shape of non-negative integers or an aligned offset.
    """
    try:
        body = json.loads(payload)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"the payload is not JSON: {_show(error)}") from None
    if not isinstance(body, dict) or not isinstance(body.get("tensors"), list):
        raise ValueError(
            'the payload must be a JSON object {"segment", "pid", "fd", "tensors": [...]} (stage_named_tensors)'
        )
    segment = body.get("segment")
    if not isinstance(segment, str) or not _SEGMENT_NAME.fullmatch(segment):
        raise ValueError(f"segment must be a slime segment name ('slime_w_' + 16 hex digits), got {_show(segment)}")
    if tag is not None and not segment.startswith(_segment_prefix(tag)):
        raise ValueError(
            f"segment {segment} is not one of this job's: its trainer names them slime_w_{tag}_...; only the "
            "trainer started with this engine's API key may push weights through shared memory"
        )
    pid, fd = body.get("pid"), body.get("fd")
    if not (_is_int(pid) and 0 < pid < 2**31 and _is_int(fd) and 0 <= fd < 2**31):
        raise ValueError(f"pid and fd must be the sender's process id and file descriptor, got {_show((pid, fd))}")
    tensors = [_parse_entry(index, entry) for index, entry in enumerate(body["tensors"])]
    return SharedPayload(segment, pid, fd, tensors)


@dataclass
class _Mapping:
    pid: int  # where the sender holds the segment open: it is gone once that no longer opens this inode
    fd: int
    inode: tuple[int, int]  # (st_dev, st_ino)
    data: torch.Tensor  # flat uint8 over a shared read-write mapping of the whole segment


def _inode(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _opens_segment(pid: int, fd: int, name: str) -> bool:
    """Whether the sender's fd is the memory file `name` (what /proc shows for a memfd of that name)."""
    try:
        return os.readlink(_fd_path(pid, fd)) == f"/memfd:{name} (deleted)"
    except OSError:
        return False


@dataclass
class MappedSegments:
    """A receiver's mappings of senders' segments by name, kept from one push to the next.

    Use it from one thread. A mapping lives as long as `mappings` or any view it handed out refers to it (a
    parameter pointed at a view keeps it); mappings of segments their sender has closed (or that died) leave
    `mappings` at the next `named_tensors`, all at `close`.
    """

    mappings: dict[str, _Mapping] = field(default_factory=dict)

    def named_tensors(self, payload: SharedPayload) -> list[tuple[str, torch.Tensor]]:
        """Views of the payload's tensors in its segment (mapped on first use), each checked to lie inside it.

        Raises:
            ValueError: the sender does not hold the segment open on this host (it is elsewhere, or the payload
                names another file), the file is not a sealed memory file of this user, or a tensor reaches
                past its end.
        """
        for name in [name for name, mapping in self.mappings.items() if not self._still_sent(mapping)]:
            del self.mappings[name]
        data = self._map(payload).data
        named = []
        for index, tensor in enumerate(payload.tensors):
            end = tensor.offset + tensor.nbytes
            if end > data.numel():
                raise ValueError(
                    f"tensors[{index}] ({tensor.name}): bytes [{tensor.offset}, {end}) reach past the end of "
                    f"segment {payload.segment} ({data.numel()} bytes)"
                )
            try:
                view = data[tensor.offset : end].view(tensor.dtype).view(tensor.shape)
            except RuntimeError as error:
                raise ValueError(
                    f"tensors[{index}] ({tensor.name}): cannot be read as {tensor.dtype}: {error}"
                ) from None
            named.append((tensor.name, view))
        return named

    def holding(self, tensors: Iterable[torch.Tensor]) -> list[str]:
        """Names of the mapped segments that any of `tensors` lives in (the answer `segments_in_use`)."""
        pointers = [tensor.data_ptr() for tensor in tensors]
        held = []
        for name, mapping in self.mappings.items():
            start = mapping.data.data_ptr()
            if any(start <= pointer < start + mapping.data.numel() for pointer in pointers):
                held.append(name)
        return held

    @staticmethod
    def _still_sent(mapping: _Mapping) -> bool:
        try:
            return _inode(os.stat(_fd_path(mapping.pid, mapping.fd))) == mapping.inode
        except OSError:
            return False

    def _map(self, payload: SharedPayload) -> _Mapping:
        name = payload.segment
        mapping = self.mappings.get(name)
        if mapping is not None:
            return mapping
        # The payload names a file descriptor of some process: open it only if /proc shows our memory file there,
        # and check again on what was opened (the sender could swap it in between).
        if not _opens_segment(payload.pid, payload.fd, name):
            raise ValueError(
                f"there is no shared-memory segment {name} at fd {payload.fd} of process {payload.pid} on this "
                f"host: load_format {SHARED_MEMORY_FORMAT!r} needs the trainer on the engine's host (--colocate); "
                "use the broadcast or disk transport otherwise"
            )
        try:
            fd = os.open(_fd_path(payload.pid, payload.fd), os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            raise ValueError(f"cannot open shared-memory segment {name}: {error.strerror}") from None
        try:
            info = os.fstat(fd)
            if not _opens_segment(os.getpid(), fd, name) or not stat.S_ISREG(info.st_mode):
                raise ValueError(f"shared-memory segment {name} is not a memory file; it was not made by a trainer")
            if info.st_uid != os.geteuid():
                raise ValueError(f"shared-memory segment {name} belongs to another user; it was not made by a trainer")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & _SEALS != _SEALS:
                # Unsealed, it could shrink after we map it, and reading past a shrunk end is a SIGBUS.
                raise ValueError(
                    f"shared-memory segment {name} is not sealed against shrinking; it was not made by a trainer"
                )
            try:
                data = torch.frombuffer(mmap.mmap(fd, 0), dtype=torch.uint8)
            except (OSError, ValueError) as error:  # an empty file cannot be mapped
                raise ValueError(f"cannot map shared-memory segment {name}: {error}") from None
        finally:
            os.close(fd)  # the mapping keeps the memory
        mapping = self.mappings[name] = _Mapping(payload.pid, payload.fd, _inode(info), data)
        return mapping

    def close(self) -> None:
        """Forget every mapping (each is unmapped once the views handed out are gone too)."""
        self.mappings.clear()


def host_group_store(
    master_address: str, world_size: int, timeout: datetime.timedelta = datetime.timedelta(minutes=30)
) -> dist.TCPStore:
    """A group's rank-0 TCP store (the training group's, `init_process_group_like_sglang`'s), listening on a port the
    kernel picks as it binds (`store.port`): no other process can take the port between choosing it and listening on
    it, as one could with a port probed free beforehand."""
    return dist.TCPStore(master_address, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def init_process_group_like_sglang(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    store: dist.TCPStore | None = None,
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
        store: Rank 0's store, already listening on `master_port` (`host_group_store`); None: create it here.

    Returns:
        The group; pass it to `torch.distributed.broadcast(tensor, src=0, group=group)`, and to
        `torch.distributed.destroy_process_group` to leave it.
    """
    if store is None:
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
