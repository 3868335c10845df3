"""Dequantize a block-wise FP8 HF checkpoint (tools/convert_hf_to_fp8.py's output, or DeepSeek-V3's) to bf16 or fp32.

Each FP8 weight is multiplied by its `<name>_scale_inv`, block by block (`slime.utils.fp8`); the scales are
dropped, the other tensors are cast to `--dtype` too, and config.json loses its `quantization_config`. Use it
to train from an FP8 release, whose weights a trainer cannot take as they are.

Usage:
    python tools/fp8_cast_bf16.py --input-fp8-hf-path /root/DeepSeek-V3 --output-bf16-hf-path /root/DeepSeek-V3-bf16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from slime.utils.fp8 import checkpoint_fp8_block, convert_hf_folder, dequantize_named_tensors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-fp8-hf-path", required=True, help="Block-FP8 HF folder (config has quant_method fp8).")
    parser.add_argument("--output-bf16-hf-path", required=True, help="Where to write the folder; must not exist yet.")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of every floating-point tensor."
    )
    args = parser.parse_args(argv)
    config_path = Path(args.input_fp8_hf_path) / "config.json"
    if not config_path.is_file():
        parser.error(f"--input-fp8-hf-path {args.input_fp8_hf_path} has no config.json; pass a HF model folder")
    config = json.loads(config_path.read_text())
    try:
        block = checkpoint_fp8_block(config)
    except ValueError as error:
        parser.error(f"--input-fp8-hf-path {args.input_fp8_hf_path}: {error}")
    if block is None:
        parser.error(
            f"--input-fp8-hf-path {args.input_fp8_hf_path}: its config.json has no fp8 quantization_config; "
            "it is not an FP8 checkpoint"
        )
    dtype = getattr(torch, args.dtype)
    del config["quantization_config"]
    config["dtype"] = args.dtype
    if "torch_dtype" in config:  # the key of configs written before transformers 5
        config["torch_dtype"] = args.dtype

    def cast(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        named = dequantize_named_tensors(named, block, dtype)
        return [(name, t.to(dtype) if t.dtype.is_floating_point else t) for name, t in named]

    try:
        out = convert_hf_folder(args.input_fp8_hf_path, args.output_bf16_hf_path, cast, config, "--output-bf16-hf-path")
    except (FileExistsError, ValueError) as error:
        parser.error(str(error))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
