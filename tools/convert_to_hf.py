"""Export any Megatron checkpoint slime saved to an HF folder, reusing the training command line.

Pass the same flags as training (MODEL_ARGS, CKPT_ARGS, ...) plus `--output-dir`: `--load` is the
checkpoint root, `--hf-checkpoint` the HF folder whose config and tokenizer are copied. Flags that do
not describe the model (rollout, SGLang, ...) are ignored. In one process the parallel layout flags
are ignored too: the checkpoint is resharded on load.

Usage:
    python tools/convert_to_hf.py ${MODEL_ARGS[@]} ${CKPT_ARGS[@]} --output-dir /root/export [--ckpt-step 100]
"""

from __future__ import annotations

import argparse
import logging

from slime.backends.megatron_utils.standalone import export_checkpoint_to_hf, megatron_flags, model_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="Checkpoint root (with latest_checkpointed_iteration.txt).")
    parser.add_argument("--hf-checkpoint", required=True, help="The HF folder training started from.")
    parser.add_argument(
        "--output-dir",
        required=True,
        help="Where to write the HF folder: absent, or an earlier slime export (replaced whole).",
    )
    parser.add_argument("--ckpt-step", type=int, default=None, help="Iteration to export (default: the latest).")
    parser.add_argument("--model-name", default=None, help="Model family (default: the config's model_type).")
    parser.add_argument("--dtype", default=None, help="Weight dtype, e.g. bfloat16 (default: the HF config's).")
    known, rest = parser.parse_known_args(argv)

    args = model_args(known.hf_checkpoint, megatron_flags(rest))
    export_checkpoint_to_hf(
        args, known.load, known.output_dir, known.hf_checkpoint, known.model_name, known.dtype, known.ckpt_step
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
