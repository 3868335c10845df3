"""Model weights of the CPU engine: load, replace by name, free and restore, and the two live transports.

Names are HuggingFace parameter names (`model.layers.0.self_attn.q_proj.weight`, ...), as in
the model's `state_dict`; tied aliases (`lm_head.weight` of a tied model) are accepted too.

Transports from a trainer:
- same host: `serialize_named_tensors` pickles tensors with torch's shared-memory reductions
  using the `file_system` strategy (a named shared-memory segment; the default file-descriptor
  strategy only works between a parent and its children) and base64-encodes the bytes, which is
  what SGLang's `MultiprocessingSerializer` sends as `serialized_named_tensors`.
  `deserialize_named_tensors` maps the segments; only one copy (into the parameters) is made.
  The payload is a pickle: only accept it from a trusted trainer (the server binds 127.0.0.1).
- any host: `init_weight_update_group` builds a gloo process group on its own TCP store, outside
  any `torch.distributed` default group, so trainer rank 0 and the engines form a small world of
  their own; rank 0 then `broadcast_tensor`s every tensor.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime
import gc
import io
import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def load_model(model_path: str | Path, dtype: torch.dtype = torch.float32, tokenizer_path: str | Path | None = None):
    """Load a HF causal LM and its tokenizer for inference on CPU.

    The parameters are copied out of the memory-mapped checkpoint, so later writes to the
    checkpoint folder (or its deletion) cannot change or break the running model.

    Args:
        model_path: A local HF folder with safetensors weights.
        dtype: Parameter dtype; float32 on CPUs without fast bf16.
        tokenizer_path: Folder of the tokenizer when it is not `model_path`.

    Returns:
        (model in eval mode, tokenizer).
    """
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
    return model, tokenizer


def weight_targets(model) -> dict[str, torch.Tensor]:
    """Every name a weight update may use, mapped to the live tensor (tied aliases included)."""
    targets = dict(model.state_dict(keep_vars=True))
    targets.update(model.named_parameters(remove_duplicate=False))
    return targets


def check_names_and_shapes(targets: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError listing every unknown name or wrong shape before anything is written."""
    unknown = [name for name in shapes if name not in targets]
    wrong = [
        f"{name}: got {list(shape)}, expected {list(targets[name].shape)}"
        for name, shape in shapes.items()
        if name in targets and tuple(shape) != tuple(targets[name].shape)
    ]
    problems = []
    if unknown:
        problems.append(f"unknown parameter names {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    if wrong:
        problems.append(f"wrong shapes ({'; '.join(wrong[:8])})")
    if problems:
        raise ValueError("weight update rejected, nothing was changed: " + " and ".join(problems))


@torch.no_grad()
def copy_named_tensors(targets: dict[str, torch.Tensor], named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Check all names and shapes, then copy each tensor into the parameter of that name (casting dtype)."""
    check_names_and_shapes(targets, {name: tuple(tensor.shape) for name, tensor in named_tensors})
    for name, tensor in named_tensors:
        targets[name].copy_(tensor)


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The `*.safetensors` files of a HF folder (or the file itself); ValueError naming the path when none."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if not path.is_dir():
        raise ValueError(f"model_path {str(model_path)!r} is neither a directory nor a .safetensors file")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_path {str(model_path)!r} holds no *.safetensors files")
    return files


def safetensors_names(model_path: str | Path) -> set[str]:
    """Names of all tensors stored under `model_path` (read from the headers only)."""
    names: set[str] = set()
    for file in safetensors_files(model_path):
        with safe_open(file, framework="pt") as reader:
            names.update(reader.keys())
    return names


@torch.no_grad()
def load_safetensors_folder(targets: dict[str, torch.Tensor], model_path: str | Path) -> set[str]:
    """Copy every tensor of a HF safetensors folder (or one file) into the parameter of the same name.

    Names and shapes are all checked first, so a bad folder changes nothing.

    Returns:
        The names that were loaded.
    """
    files = safetensors_files(model_path)
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            shapes.update({name: tuple(reader.get_slice(name).get_shape()) for name in reader.keys()})
    check_names_and_shapes(targets, shapes)
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                targets[name].copy_(reader.get_tensor(name))
    return set(shapes)


def parameters_missing_from(model, names: set[str]) -> list[str]:
    """Parameters none of whose names (tied aliases included) is in `names`."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    return [group[0] for group in aliases.values() if not names.intersection(group)]


def save_weights(model, path: str | Path) -> None:
    """Write the model's weights (one copy of each tied tensor) to one safetensors file."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(path))


def free_parameters(model) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Swap every parameter's storage for an empty one so its memory goes back to the OS.

    The `Parameter` objects stay (so tying and `weight_targets` stay valid); only their data goes.

    Returns:
        name -> (shape, dtype) of each parameter, for `allocate_parameters`.
    """
    layout = {}
    for name, param in model.named_parameters():
        layout[name] = (param.shape, param.dtype)
        param.data = torch.empty(0, dtype=param.dtype)
    gc.collect()
    # glibc keeps freed heap pages unless asked; large tensors were mmap-ed and are already gone.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return layout


def allocate_parameters(model, layout: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """Give every parameter freed by `free_parameters` fresh (uninitialized) storage again."""
    params = dict(model.named_parameters())
    for name, (shape, dtype) in layout.items():
        params[name].data = torch.empty(shape, dtype=dtype)


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Put CPU tensors in shared memory and return the base64 pickle an engine on this host can map.

    The caller's tensors are copied, not moved; the shared segments live until the engine has
    mapped and released them.

    Args:
        named_tensors: (HF parameter name, tensor) pairs.

    Returns:
        One element of `serialized_named_tensors` for /update_weights_from_tensor.
    """
    shared = [(name, tensor.detach().to("cpu", copy=True).contiguous()) for name, tensor in named_tensors]
    buffer = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(shared)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`; ValueError when the payload is not a list of (name, tensor)."""
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


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
) -> dist.ProcessGroup:
    """Join (rank 0: host) a gloo group of its own; blocks until all `world_size` ranks have joined.

    Both sides (trainer rank 0 and every engine) call this with the same address, port and name.

    Args:
        master_address: Host of rank 0, where the TCP store listens.
        master_port: Port of that store.
        rank: This process's rank; the trainer is 0, engines use `rank_offset`.
        world_size: 1 (trainer) + number of engine ranks.
        group_name: Prefix for the store keys, so several groups may share one store port over time.
        timeout: For joining and for each collective.

    Returns:
        A `ProcessGroupGloo`; pass it to `broadcast_tensor`.
    """
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"{group_name}/", store)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Bind where the master is reachable; loopback needs no interface lookup by hostname.
    loopback = master_address in ("127.0.0.1", "localhost", "::1")
    device = (
        dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        if loopback
        else dist.ProcessGroupGloo.create_default_device()
    )
    options._devices = [device]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def broadcast_tensor(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast `tensor` in place from rank `src` of a group made by `init_weight_update_group`."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    group.broadcast([tensor], options).wait()


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError naming the string otherwise."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype
