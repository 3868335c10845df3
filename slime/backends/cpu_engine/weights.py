"""Model weights of the CPU engine: load, replace by name, free and restore.

Names are HuggingFace parameter names (`model.layers.0.self_attn.q_proj.weight`, ...), as in
the model's `state_dict`; tied aliases (`lm_head.weight` of a tied model) are accepted too.
The live transports from a trainer (shared-memory payloads, a broadcast group built the SGLang
way) are in `slime.utils.weight_transport`, shared with the trainers that send.
"""

from __future__ import annotations

import contextlib
import os
import stat
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.utils import logging as hf_logging

from slime.utils import fp8, weight_delta
from slime.utils.misc import load_pretrained, release_free_host_memory
from slime.utils.processing_utils import is_vision_language, load_tokenizer


def load_model(
    model_path: str | Path,
    dtype: torch.dtype = torch.float32,
    tokenizer_path: str | Path | None = None,
    trust_remote_code: bool = False,
):
    """Load a HF causal LM, or a vision-language model (by its config, see `vision.is_vision_language`), and its
    tokenizer for inference on CPU.

    The parameters are copied out of the memory-mapped checkpoint, so later writes to the
    checkpoint folder (or its deletion) cannot change or break the running model. A block-FP8 checkpoint (its
    config.json's `quantization_config`, see `slime.utils.fp8`) is dequantized to `dtype` exactly, and the model
    runs FP8 from then on (`enable_fp8`).

    Args:
        model_path: A local HF folder with safetensors weights.
        dtype: Parameter dtype; float32 on CPUs without fast bf16.
        tokenizer_path: Folder of the tokenizer when it is not `model_path`.
        trust_remote_code: Let transformers run Python code shipped in the folder (else such a folder is refused).

    Returns:
        (model in eval mode, tokenizer).
    """
    config = load_pretrained(AutoConfig, str(model_path), trust_remote_code)
    loader = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    fp8_block = fp8.folder_fp8_block(model_path)
    if fp8_block is not None:
        # transformers would dequantize through bf16 (on CPU) or keep FP8 kernels (on GPU): load the FP8 tensors
        # as plain ones here, then overwrite them with their exact dequantization below.
        del config.quantization_config
    with _quiet_transformers(fp8_block is not None):  # it would list every `_scale_inv` as an unexpected key
        model = load_pretrained(loader, str(model_path), trust_remote_code, dtype=dtype, config=config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    if fp8_block is not None:
        _FP8_BLOCKS[model] = fp8_block
        load_safetensors_folder(weight_targets(model), model_path)
    tokenizer = load_tokenizer(str(tokenizer_path or model_path), trust_remote_code=trust_remote_code)
    return model, tokenizer


@contextlib.contextmanager
def _quiet_transformers(quiet: bool):
    previous = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


# model -> {checkpoint name: live name}, computed once per model
_CHECKPOINT_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> FP8 block size, for models that run FP8 (`enable_fp8`)
_FP8_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class WeightTargets(dict):
    """What `weight_targets` returns: name -> live tensor, and `fp8_block`, the block size of a model that runs FP8
    (None otherwise), which says how the update functions below load what they are given."""

    fp8_block: fp8.Block | None = None


@torch.no_grad()
def enable_fp8(model, block: fp8.Block = fp8.DEFAULT_BLOCK) -> None:
    """Run the model in FP8 (SGLang's `--quantization fp8`): round its quantized weights (`fp8.is_fp8_quantized`)
    through block FP8 now, and every such weight that later updates load, unless it comes quantized already.

    The CPU has no FP8 matmul: the weights stay in the compute dtype, holding only values FP8 can express, which
    is what an FP8 engine computes with. A model loaded from an FP8 checkpoint is FP8 already (nothing changes).
    """
    if model in _FP8_BLOCKS:
        return
    _FP8_BLOCKS[model] = block
    targets = {name: t for name, t in model.named_parameters() if fp8.is_fp8_quantized(name, t)}
    for name, tensor in _as_loaded(weight_targets(model), list(targets.items())):
        targets[name].copy_(tensor)


def _as_loaded(targets: dict[str, torch.Tensor], named_tensors: list[tuple[str, torch.Tensor]]) -> list:
    """The tensors an update writes: each FP8 tensor merged with its `<name>_scale_inv` companion (dequantized),
    and on a model that runs FP8 every other quantized weight rounded through FP8; ValueError on a bad pair."""
    block = getattr(targets, "fp8_block", None)
    quantized = {name.removesuffix(fp8.SCALE_SUFFIX) for name, _ in named_tensors if name.endswith(fp8.SCALE_SUFFIX)}
    quantized.update(name for name, t in named_tensors if t.dtype == fp8.FP8_DTYPE)
    if block is not None:
        named_tensors = [
            (name, fp8.dequantize_block_fp8(*fp8.quantize_block_fp8(t, block), block, t.dtype))
            if name not in quantized and name in targets and fp8.is_fp8_quantized(name, t)
            else (name, t)
            for name, t in named_tensors
        ]
    if not quantized:
        return named_tensors
    try:
        return fp8.dequantize_named_tensors(named_tensors, block or fp8.DEFAULT_BLOCK)
    except ValueError as error:
        raise ValueError(f"weight update rejected, nothing was changed: {error}") from None


def _without_scales(shapes: dict) -> dict:
    """`shapes` (name -> anything) less the `<name>_scale_inv` entries whose `<name>` is there too: a scale is no
    parameter, it is checked with its weight when the two are merged (`_as_loaded`)."""
    return {
        name: value
        for name, value in shapes.items()
        if not (name.endswith(fp8.SCALE_SUFFIX) and name.removesuffix(fp8.SCALE_SUFFIX) in shapes)
    }


def checkpoint_names(model) -> dict[str, str]:
    """Names the model's weights have in a saved HF checkpoint, where they differ from its live `state_dict` names.

    transformers 5 renames some families on load (Qwen2.5-VL: `model.layers.*` -> `model.language_model.layers.*`,
    `visual.*` -> `model.visual.*`) and back on save; Megatron's HF export and hub checkpoints use the saved names,
    an FSDP trainer the live ones. Only renamings count: tensors a converter fuses (MoE experts) are mapped by
    `weight_targets` itself.
    """
    if model not in _CHECKPOINT_NAMES:
        from transformers.core_model_loading import revert_weight_conversion

        # Meta tensors: a converter run on them costs nothing; its outputs are new tensors and are skipped.
        live = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in model.state_dict().items()}
        by_id = {id(t): name for name, t in live.items()}
        saved = revert_weight_conversion(model, dict(live))
        _CHECKPOINT_NAMES[model] = {
            name: by_id[id(t)] for name, t in saved.items() if id(t) in by_id and by_id[id(t)] != name
        }
    return _CHECKPOINT_NAMES[model]


def weight_targets(model) -> WeightTargets:
    """Every name a weight update may use, mapped to the live tensor (tied aliases and checkpoint names included),
    with the model's FP8 block size if it runs FP8.

    transformers 5 fuses an MoE layer's experts into 3-D `experts.gate_up_proj` / `experts.down_proj` tensors, while
    hub checkpoints and Megatron's HF export name them one expert at a time (`experts.{E}.gate_proj.weight`, ...):
    those names map to views into the fused tensors. Views go stale when a parameter's data is swapped (release,
    adopted segments), so build the targets afresh for each update.
    """
    targets = WeightTargets(model.state_dict(keep_vars=True))
    targets.fp8_block = _FP8_BLOCKS.get(model)
    targets.update(model.named_parameters(remove_duplicate=False))
    targets.update({saved: targets[live] for saved, live in checkpoint_names(model).items()})
    for name, tensor in list(targets.items()):
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith(".experts") or tensor.dim() != 3 or kind not in ("gate_up_proj", "down_proj"):
            continue
        data = tensor.detach()
        for expert in range(data.shape[0]):
            if kind == "gate_up_proj":  # gate rows, then up rows
                half = data.shape[1] // 2
                targets[f"{prefix}.{expert}.gate_proj.weight"] = data[expert, :half]
                targets[f"{prefix}.{expert}.up_proj.weight"] = data[expert, half:]
            else:
                targets[f"{prefix}.{expert}.down_proj.weight"] = data[expert]
    return targets


def check_names_and_shapes(
    targets: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    float_kinds: dict[str, bool] | None = None,
) -> None:
    """Raise ValueError listing every unknown name, wrong shape or wrong kind of dtype before anything is written.

    Args:
        targets: From `weight_targets`.
        shapes: name -> shape of the incoming tensor.
        float_kinds: name -> whether the incoming dtype is floating point; a floating-point parameter takes
            only floating-point tensors and an integer buffer only integer ones (any width: they are cast).
    """
    unknown = [name for name in shapes if name not in targets]
    wrong = [
        f"{name}: got {list(shape)}, expected {list(targets[name].shape)}"
        for name, shape in shapes.items()
        if name in targets and tuple(shape) != tuple(targets[name].shape)
    ]
    wrong_kind = [
        f"{name}: got a {'floating-point' if is_float else 'non-floating-point'} tensor for {targets[name].dtype}"
        for name, is_float in (float_kinds or {}).items()
        if name in targets and is_float != targets[name].dtype.is_floating_point
    ]
    problems = []
    if unknown:
        problems.append(f"unknown parameter names {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    if wrong:
        problems.append(f"wrong shapes ({'; '.join(wrong[:8])})")
    if wrong_kind:
        problems.append(f"wrong dtypes ({'; '.join(wrong_kind[:8])})")
    if problems:
        raise ValueError("weight update rejected, nothing was changed: " + " and ".join(problems))


# The dtype `all_finite` sums each floating-point dtype in (half precisions would overflow at 65504 in fp16).
_SUMMABLE = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
}


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds no NaN and no infinity.

    A sum with a NaN or an infinity among its terms is itself NaN or infinite, so a finite sum settles it in one
    pass (4 ms for 64 MB on one core, where `isfinite(t).all()` takes 80); only a sum that is not finite, which
    finite terms of huge magnitude can also give, is checked element by element.
    """
    accumulate = _SUMMABLE.get(tensor.dtype)
    if accumulate is None:  # FP8: no sum or isfinite of their own; float32 holds every value
        return bool(torch.isfinite(tensor.float()).all())
    return bool(torch.isfinite(tensor.sum(dtype=accumulate))) or bool(torch.isfinite(tensor).all())


def check_finite(named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError naming the floating-point tensors that hold a NaN or an infinity (no trained model does: such
    an update would only make every later sample garbage), before anything is written."""
    bad = [name for name, t in named_tensors if t.dtype.is_floating_point and not all_finite(t)]
    if bad:
        raise ValueError(
            f"weight update rejected, nothing was changed: NaN or infinite values in {bad[:8]}"
            f"{' ...' if len(bad) > 8 else ''}"
        )


def check_update(targets: dict[str, torch.Tensor], named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Every check an update passes before its first tensor is written: names, shapes, dtype kinds, finite values.
    Give it the tensors as `_as_loaded` makes them (FP8 pairs merged)."""
    check_names_and_shapes(
        targets,
        {name: tuple(tensor.shape) for name, tensor in named_tensors},
        {name: tensor.dtype.is_floating_point for name, tensor in named_tensors},
    )
    check_finite(named_tensors)


@torch.no_grad()
def copy_named_tensors(targets: dict[str, torch.Tensor], named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Check the whole update (`check_update`), then copy each tensor into the parameter of that name (casting dtype).
    FP8 tensors with their `<name>_scale_inv` are dequantized first."""
    named_tensors = _as_loaded(targets, named_tensors)
    check_update(targets, named_tensors)
    for name, tensor in named_tensors:
        targets[name].copy_(tensor)


@torch.no_grad()
def adopt_named_tensors(targets: dict[str, torch.Tensor], named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Like `copy_named_tensors`, but a parameter of the tensor's dtype is pointed at the tensor itself.

    For tensors that stay valid and unchanged until a later update replaces them (views into a trainer's
    shared memory that it leaves alone while the engine holds it). Buffers and other dtypes are copied, and FP8
    tensors dequantized (into new tensors, then adopted).
    """
    named_tensors = _as_loaded(targets, named_tensors)
    check_update(targets, named_tensors)
    for name, tensor in named_tensors:
        target = targets[name]
        if isinstance(target, torch.nn.Parameter) and target.dtype == tensor.dtype:
            target.data = tensor  # the Parameter object stays, so modules and tied aliases see the new data
        else:
            target.copy_(tensor)


def drain_named_tensors(
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]], receive: Callable[[torch.Tensor], None]
) -> None:
    """Receive every tensor of `layout` into scratch buffers and drop it: a refused update must still
    take the sender's broadcasts, or the sender hangs."""
    for _, dtype, shape in layout:
        receive(torch.empty(shape, dtype=dtype))


@torch.no_grad()
def receive_named_tensors(
    targets: dict[str, torch.Tensor],
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
    receive: Callable[[torch.Tensor], None],
) -> None:
    """Fill the named parameters with tensors that `receive(buffer)` writes, one per `layout` entry, in order.

    Names, shapes and dtype kinds are all checked before the first tensor is received. Every tensor is received
    into a buffer of its own and checked (`check_finite`) before any parameter is written, so a transport failure
    halfway (the sender died) or a NaN in the last tensor leaves the model as it was; the price is a second copy
    of the weights for the length of the update. Every tensor is received even when the update is rejected (the
    sender's collectives would hang otherwise).

    Raises:
        ValueError: naming every unknown name, wrong shape or non-finite tensor (after receiving everything).
    """
    try:
        check_names_and_shapes(
            targets,
            _without_scales({name: tuple(shape) for name, _, shape in layout}),
            _without_scales({name: dtype.is_floating_point for name, dtype, _ in layout}),
        )
    except ValueError:
        drain_named_tensors(layout, receive)
        raise
    received = []
    for name, dtype, shape in layout:
        buffer = torch.empty(shape, dtype=dtype)
        receive(buffer)
        received.append((name, buffer))
    received = _as_loaded(targets, received)
    check_finite(received)
    for name, buffer in received:
        targets[name].copy_(buffer)


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The `*.safetensors` files of a HF folder (or the file itself); ValueError naming the path when none."""
    path = Path(model_path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model_path {str(model_path)!r} holds no *.safetensors files")
    elif path.suffix == ".safetensors":
        files = [path]  # checked below like a folder's files
    else:
        raise ValueError(f"model_path {str(model_path)!r} is neither a directory nor a .safetensors file")
    # Only regular files are opened: a FIFO or a device named *.safetensors would block the engine in open().
    odd = [str(f) for f in files if not (f.exists() and stat.S_ISREG(f.stat().st_mode))]
    if odd:
        raise ValueError(f"model_path {str(model_path)!r}: {odd[:4]} are not regular files; only those are read")
    return files


def read_regular_file(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of `path`, which must be a regular file (of at most `max_bytes`); ValueError naming it otherwise.

    Opened non-blocking and checked on the open descriptor, so a FIFO or device put there (even after a
    check by name) is refused instead of blocking the engine in open() or read().
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise ValueError(f"cannot open {str(path)!r}: {error.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{str(path)!r} is not a regular file; only regular files are read")
        too_big = f"{str(path)!r} is larger than the {max_bytes} bytes it may hold"
        if max_bytes is not None and info.st_size > max_bytes:
            raise ValueError(too_big)
        data = file.read(max_bytes + 1 if max_bytes is not None else -1)
        if max_bytes is not None and len(data) > max_bytes:  # grew after the check
            raise ValueError(too_big)
        return data


def _read_header(file: Path):
    """`safe_open(file)`, with a file that is no safetensors file named in a ValueError (it is the caller's)."""
    try:
        return safe_open(file, framework="pt")
    except Exception as error:  # SafetensorError: bad header, truncated, not safetensors at all
        raise ValueError(f"{file} is not a readable safetensors file ({error})") from None


def safetensors_names(model_path: str | Path) -> set[str]:
    """Names of all tensors stored under `model_path` (read from the headers only)."""
    names: set[str] = set()
    for file in safetensors_files(model_path):
        with _read_header(file) as reader:
            names.update(reader.keys())
    return names


@torch.no_grad()
def load_safetensors_folder(targets: dict[str, torch.Tensor], model_path: str | Path) -> set[str]:
    """Copy every tensor of a HF safetensors folder (or one file) into the parameter of the same name.

    Names, shapes and values are all checked first, so a bad folder changes nothing.

    Returns:
        The names that were loaded.
    """
    files = safetensors_files(model_path)
    shapes, float_kinds = {}, {}
    for file in files:
        with _read_header(file) as reader:
            for name in reader.keys():
                header = reader.get_slice(name)
                shapes[name] = tuple(header.get_shape())
                float_kinds[name] = header.get_dtype().startswith(("F", "BF"))  # F32, F16, BF16, F8_E4M3, ...
    check_names_and_shapes(targets, _without_scales(shapes), _without_scales(float_kinds))
    loaded = []  # every tensor read and checked before the first parameter is written
    for file in files:
        with _read_header(file) as reader:
            try:
                loaded += [(name, reader.get_tensor(name)) for name in reader.keys()]
            except Exception as error:  # a tensor past the end of a truncated file
                raise ValueError(f"{file}: cannot read its tensors ({error}); nothing was changed") from None
    loaded = _as_loaded(targets, loaded)
    check_finite(loaded)
    for name, tensor in loaded:
        targets[name].copy_(tensor)
    return set(_without_scales(shapes))


@torch.no_grad()
def rebuild_delta_folder(
    targets: dict[str, torch.Tensor], model_path: str | Path, held_version: str
) -> list[tuple[str, torch.Tensor]] | None:
    """The new tensors of a delta folder (`slime.utils.weight_delta`, `--update-weight-mode delta`), rebuilt from
    the weights held and checked against their checksums; None when `model_path` holds full weights.

    Raises:
        ValueError: unknown names or wrong shapes; `weight_delta.DeltaMismatch` naming the tensor (or the base
            version) that does not match. Nothing is written either way.
    """
    manifest = weight_delta.read_manifest(model_path) if Path(model_path).is_dir() else None
    if manifest is None:
        return None
    entries = manifest["tensors"]
    check_names_and_shapes(targets, {name: tuple(entry["shape"]) for name, entry in entries.items()})
    return weight_delta.rebuild_tensors(model_path, manifest, held_version, lambda name: targets[name].detach())


def parameters_missing_from(model, names: set[str]) -> list[str]:
    """Parameters none of whose names (tied aliases and checkpoint names included) is in `names`."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    for saved, live in checkpoint_names(model).items():
        if live in params:
            aliases[id(params[live])].append(saved)
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
    # large tensors were mmap-ed and are already gone; glibc keeps the rest unless asked
    release_free_host_memory()
    return layout


def parameter_bytes(model) -> int:
    """Bytes of the storages the parameters hold now (each shared storage once): 0 after `free_parameters`."""
    storages = {param.untyped_storage().data_ptr(): param.untyped_storage().nbytes() for param in model.parameters()}
    return sum(size for ptr, size in storages.items() if ptr)


def allocate_parameters(model, layout: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """Give every parameter freed by `free_parameters` fresh (uninitialized) storage again."""
    params = dict(model.named_parameters())
    for name, (shape, dtype) in layout.items():
        params[name].data = torch.empty(shape, dtype=dtype)


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError naming the string otherwise."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype
