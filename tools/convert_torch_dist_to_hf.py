"""Convert a Megatron torch_dist checkpoint back into an HF folder.

The architecture comes from `--origin-hf-dir` (the HF model the checkpoint started from); its config,
tokenizer and chat template are copied next to the new safetensors weights. Megatron model flags on
the command line override the derived ones.

Usage:
    python tools/convert_torch_dist_to_hf.py --input-dir /root/Qwen3-4B_slime/iter_0000100 \\
        --output-dir /root/Qwen3-4B_step100 --origin-hf-dir /root/Qwen3-4B

`--input-dir` may also be the checkpoint root (then the tracker file picks the iteration).
Without CUDA it runs on the CPU with gloo.
"""

from __future__ import annotations

import argparse
import logging

from slime.backends.megatron_utils.standalone import export_checkpoint_to_hf, megatron_flags, model_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-dir", required=True, help="torch_dist checkpoint: an iter_XXXXXXX dir or its root.")
    parser.add_argument(
        "--output-dir",
        required=True,
        help="Where to write the HF folder: absent, or an earlier slime export (replaced whole).",
    )
    parser.add_argument("--origin-hf-dir", required=True, help="The HF folder the model came from.")
    parser.add_argument("--model-name", default=None, help="Model family (default: the config's model_type).")
    parser.add_argument("--dtype", default=None, help="Weight dtype, e.g. bfloat16 (default: the origin config's).")
    known, rest = parser.parse_known_args(argv)

    args = model_args(known.origin_hf_dir, megatron_flags(rest))
    export_checkpoint_to_hf(args, known.input_dir, known.output_dir, known.origin_hf_dir, known.model_name, known.dtype)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
