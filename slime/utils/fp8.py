"""Block-wise FP8 weights, the format of SGLang's `--quantization fp8` and of DeepSeek-V3-style FP8 checkpoints.

A quantized weight `W` of shape [out, in] is stored as two tensors: `W` in float8_e4m3fn and `W_scale_inv` in
float32 of shape [ceil(out / 128), ceil(in / 128)], one scale per 128 x 128 block, such that
`W ≈ W_fp8 * W_scale_inv` block by block. The checkpoint's config.json says so in `quantization_config`
(`fp8_quantization_config`). Only the 2-D Linear weights of the decoder layers are quantized
(`is_fp8_quantized`); embeddings, norms, the LM head, biases and MoE routers keep their dtype.

Pure tensor functions, shared by the conversion tools, the trainer's weight pushes (which quantize every bucket
when the engines run FP8) and the CPU engine (which dequantizes on load).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448 = 1.75 * 2**8, the largest finite e4m3 value
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # `<weight name>_scale_inv`, the name SGLang's and DeepSeek's loaders expect
# Leaves of 2-D decoder weights that are no Linear to quantize: MoE routers (`mlp.gate`, `router`), the MTP
# projection and DSA's indexer projection, as upstream's converter leaves them.
_KEPT_LEAVES = ("norm", "embed", "lm_head", "router", "mlp.gate.", "shared_expert_gate.", "eh_proj", "weights_proj")

Block = tuple[int, int]


def fp8_quantization_config(block: Block = DEFAULT_BLOCK) -> dict:
    """The `quantization_config` entry of an FP8 checkpoint's config.json (what SGLang and transformers read)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def checkpoint_fp8_block(config: dict) -> Block | None:
    """The block size of a config.json dict whose `quantization_config` is block-wise FP8, else None.

    Raises:
        ValueError: FP8 without `weight_block_size` (per-tensor or per-channel scales), which slime does not read.
    """
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"quantization_config {quantization} is FP8 without a weight_block_size [rows, cols]; slime reads only "
            "block-wise FP8 checkpoints (tools/convert_hf_to_fp8.py writes them)"
        )
    return block[0], block[1]


def folder_fp8_block(model_path: str | Path) -> Block | None:
    """`checkpoint_fp8_block` of the config.json in a HF folder (None without one)."""
    config = Path(model_path) / "config.json"
    return checkpoint_fp8_block(json.loads(config.read_text())) if config.is_file() else None


def rollout_fp8_block(args) -> Block | None:
    """The block size of the engines' FP8 weights, which every weight push then quantizes to; None when the engines
    run in the precision the trainer sends.

    The engines run FP8 when `--hf-checkpoint` is a block-FP8 folder (its block size) or with
    `--sglang-quantization fp8` on the CPU engine, which rounds its bf16/fp32 checkpoint to 128 x 128 blocks.

    Args:
        args: Needs `hf_checkpoint`, `rollout_backend` and `sglang_server_args` (the `--sglang-*` flags given).

    Raises:
        ValueError: `--sglang-quantization fp8` for SGLang with a checkpoint that is not block FP8: SGLang would
            quantize it per tensor itself and take no block-FP8 pushes.
    """
    block = folder_fp8_block(args.hf_checkpoint) if args.hf_checkpoint else None
    quantization = args.sglang_server_args.get("quantization")
    if block is not None or quantization != "fp8":
        return block
    if args.rollout_backend == "cpu":
        return DEFAULT_BLOCK
    raise ValueError(
        f"--sglang-quantization fp8 with --hf-checkpoint {args.hf_checkpoint}, which is not block FP8: SGLang would "
        "quantize it per tensor and could not load the block-FP8 weights slime pushes. Convert it with "
        "tools/convert_hf_to_fp8.py and pass that folder as --hf-checkpoint"
    )


def is_fp8_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether a HF-named tensor is stored in FP8: the floating-point 2-D `.weight` of a decoder layer's Linear.

    Embeddings, norms, the LM head, biases, routers (`mlp.gate`, `router`) and anything outside `.layers.`
    (a vision tower) stay in their own dtype: they are small, or the error they would take hurts the most.
    """
    return (
        tensor.dim() == 2
        and tensor.dtype.is_floating_point
        and name.endswith(".weight")
        and ".layers." in name
        and not any(leaf in name for leaf in _KEPT_LEAVES)
    )


def _blocks(shape: torch.Size, block: Block) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize_block_fp8(weight: torch.Tensor, block: Block = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to e4m3 with one float32 scale per `block` (rows, cols) tile.

    Each tile is divided by `scale = amax(|tile|) / 448`, so its largest element lands on e4m3's largest value
    and the rest keep e4m3's 3 mantissa bits: an element x comes back within 2**-4 |x| (half the relative step
    2**-3 of a normal number), or within 2**-10 * scale where x / scale falls among e4m3's subnormals (below
    2**-6, absolute step 2**-9). Tiles on the right and bottom edges cover what is left (ragged blocks: their
    scale comes from the elements they hold). An all-zero tile gets scale 1 and zeros, never 0 / 0.

    The scale is returned as checkpoints store it, under the name `scale_inv`: the factor that dequantizes
    (`weight ≈ w_fp8 * scale_inv`), the inverse of the one that quantized.

    Args:
        weight: [out, in], any floating dtype (computed in float32).
        block: Tile size (rows, cols), the checkpoint's `weight_block_size`.

    Returns:
        (w_fp8 [out, in] float8_e4m3fn, scale_inv [ceil(out / rows), ceil(in / cols)] float32).
    """
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {list(weight.shape)}")
    rows, cols = block
    out_blocks, in_blocks = _blocks(weight.shape, block)
    w = weight.detach().float()
    # Zero padding to whole tiles leaves every tile's amax as its real elements make it.
    padded = torch.nn.functional.pad(w, (0, in_blocks * cols - w.shape[1], 0, out_blocks * rows - w.shape[0]))
    tiles = padded.view(out_blocks, rows, in_blocks, cols)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)  # x / (amax/448) may round past 448
    w_fp8 = scaled.view_as(padded)[: w.shape[0], : w.shape[1]].to(FP8_DTYPE)
    return w_fp8.contiguous(), scale_inv


def dequantize_block_fp8(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: Block = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Undo `quantize_block_fp8`: each tile of `w_fp8` times its `scale_inv` entry, in `dtype`.

    Raises:
        ValueError: `scale_inv` does not have one entry per `block` tile of `w_fp8` (a different block size).
    """
    expected = _blocks(w_fp8.shape, block) if w_fp8.dim() == 2 else None
    if expected is None or tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"an FP8 weight of shape {list(w_fp8.shape)} needs a scale_inv of shape {list(expected or ())} for "
            f"{block[0]}x{block[1]} blocks, got {list(scale_inv.shape)}: the sender used another weight_block_size"
        )
    rows, cols = block
    scales = scale_inv.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return (w_fp8.float() * scales[: w_fp8.shape[0], : w_fp8.shape[1]]).to(dtype)


def quantize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], block: Block = DEFAULT_BLOCK) -> list:
    """HF-named tensors as an FP8 checkpoint holds them: each `is_fp8_quantized` weight becomes its FP8 tensor
    followed by `<name>_scale_inv`; the others pass unchanged."""
    out = []
    for name, tensor in named_tensors:
        if is_fp8_quantized(name, tensor):
            w_fp8, scale_inv = quantize_block_fp8(tensor, block)
            out += [(name, w_fp8.to(tensor.device)), (name + SCALE_SUFFIX, scale_inv.to(tensor.device))]
        else:
            out.append((name, tensor))
    return out


def dequantize_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], block: Block = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32
) -> list:
    """Merge each FP8 tensor with its `<name>_scale_inv` companion into one `dtype` tensor; the rest pass unchanged.

    Raises:
        ValueError: naming an FP8 tensor without its scale, or a scale without its tensor.
    """
    named = list(named_tensors)
    scales = {name.removesuffix(SCALE_SUFFIX): t for name, t in named if name.endswith(SCALE_SUFFIX)}
    fp8_names = {name for name, t in named if t.dtype == FP8_DTYPE}
    unscaled = sorted(fp8_names - scales.keys())
    orphans = sorted(scales.keys() - fp8_names)
    if unscaled or orphans:
        problems = [f"FP8 tensors without their {SCALE_SUFFIX} companion: {unscaled[:8]}"] if unscaled else []
        problems += [f"{SCALE_SUFFIX} tensors without an FP8 weight: {orphans[:8]}"] if orphans else []
        raise ValueError("; ".join(problems) + "; send each FP8 weight and its scale in the same update")
    out = []
    for name, tensor in named:
        if name in fp8_names:
            try:
                out.append((name, dequantize_block_fp8(tensor, scales[name], block, dtype)))
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        elif not name.endswith(SCALE_SUFFIX):
            out.append((name, tensor))
    return out


def fp8_wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as gloo can broadcast it: FP8 as its raw bytes (gloo has no FP8 type), others as they are."""
    return tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor


def convert_hf_folder(
    model_dir: str | Path,
    save_dir: str | Path,
    convert: Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]],
    config: dict,
    flag: str = "--save-dir",
) -> Path:
    """Write a copy of a HF folder with every safetensors shard's tensors passed through `convert`.

    The shards keep their file names (the index's weight map is rebuilt for the new names), config.json becomes
    `config`, the other files (tokenizer, generation config, ...) are copied. Written to a staging folder beside
    `save_dir` and renamed into place at the end (`slime.utils.atomic_dir`), so a reader never sees half of it.

    Raises:
        FileExistsError: `save_dir` exists (nothing is overwritten).
        ValueError: `model_dir` holds no safetensors shards.
    """
    from safetensors.torch import load_file, save_file

    from slime.utils.atomic_dir import create_staging, publish

    source, final = Path(model_dir), Path(save_dir)
    if final.exists() or final.is_symlink():
        raise FileExistsError(f"{flag} {final} already exists; choose a new folder (nothing is overwritten)")
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{source} holds no *.safetensors files; pass a HF model folder")
    staging = create_staging(final, "hf-export", flag)
    index = source / "model.safetensors.index.json"
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", index.name):
            shutil.copyfile(path, staging / path.name)
    weight_map, total = {}, 0
    for shard in shards:
        tensors = convert(list(load_file(shard).items()))
        save_file({name: t.contiguous() for name, t in tensors}, str(staging / shard.name), metadata={"format": "pt"})
        weight_map.update((name, shard.name) for name, _ in tensors)
        total += sum(t.numel() * t.element_size() for _, t in tensors)
    if index.is_file():
        index_text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        (staging / index.name).write_text(index_text + "\n")
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return publish(staging, final, "hf-export", flag)
