"""Convert a HF checkpoint to block-wise FP8, the format of SGLang's `--quantization fp8` (FP8 rollout).

Each 2-D Linear weight of the decoder layers becomes float8_e4m3fn plus a float32 `<name>_scale_inv` with one
scale per block (`slime.utils.fp8`); embeddings, norms, the LM head, biases and routers keep their dtype, and
config.json gets the `quantization_config` SGLang and transformers read. Pass the result as `--hf-checkpoint`:
the engines load it, and every weight push is quantized the same way (the trainer keeps its own precision).

Usage:
    python tools/convert_hf_to_fp8.py --model-dir /root/Qwen3-4B --save-dir /root/Qwen3-4B-FP8 [--block-size 128 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slime.utils.fp8 import DEFAULT_BLOCK, convert_hf_folder, fp8_quantization_config, quantize_named_tensors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="HF folder with safetensors weights (bf16 or fp32).")
    parser.add_argument("--save-dir", required=True, help="Where to write the FP8 folder; must not exist yet.")
    parser.add_argument(
        "--strategy",
        default="block",
        choices=["block"],
        help="Scale granularity; only block-wise (what SGLang's fp8 block kernels run) is written.",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        nargs=2,
        default=list(DEFAULT_BLOCK),
        metavar=("ROWS", "COLS"),
        help="Rows and columns each scale covers (default 128 128, SGLang's and DeepSeek-V3's).",
    )
    args = parser.parse_args(argv)
    if min(args.block_size) < 1:
        parser.error(f"--block-size {args.block_size[0]} {args.block_size[1]}: both must be >= 1")
    config_path = Path(args.model_dir) / "config.json"
    if not config_path.is_file():
        parser.error(f"--model-dir {args.model_dir} has no config.json; pass a HF model folder")
    config = json.loads(config_path.read_text())
    if config.get("quantization_config"):
        parser.error(
            f"--model-dir {args.model_dir} is quantized already ({config['quantization_config'].get('quant_method')}); "
            "convert from the bf16/fp32 folder (tools/fp8_cast_bf16.py undoes an FP8 one)"
        )
    block = (args.block_size[0], args.block_size[1])
    config["quantization_config"] = fp8_quantization_config(block)
    try:
        out = convert_hf_folder(
            args.model_dir, args.save_dir, lambda named: quantize_named_tensors(named, block), config
        )
    except (FileExistsError, ValueError) as error:
        parser.error(str(error))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
