"""Export any Megatron checkpoint slime saved to an HF folder, reusing the training command line; or the adapter of
a LoRA run (`--lora-rank`) as a PEFT folder, or merged into the base with `--merge-lora`.

Pass the same flags as training (MODEL_ARGS, CKPT_ARGS, ...) plus `--output-dir`: `--load` is the
checkpoint root, `--hf-checkpoint` the HF folder whose config and tokenizer are copied. Flags that do
not describe the model (rollout, SGLang, ...) are ignored. In one process the parallel layout flags
are ignored too: the checkpoint is resharded on load.

Usage:
    python tools/convert_to_hf.py ${MODEL_ARGS[@]} ${CKPT_ARGS[@]} --output-dir /root/export [--ckpt-step 100]
    python tools/convert_to_hf.py --load /root/lora_run --hf-checkpoint /root/base --output-dir /root/adapter \
        [--merge-lora]
"""

from __future__ import annotations

import argparse
import logging

from slime.utils.lora_export import checkpoint_adapter, export_adapter


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
    parser.add_argument(
        "--dtype",
        default=None,
        help="Weight dtype, e.g. bfloat16 (default: the HF config's; float32 for --merge-lora).",
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="A LoRA run's checkpoint: write the base with the adapter merged in (default: the PEFT adapter folder).",
    )
    known, rest = parser.parse_known_args(argv)

    adapter = checkpoint_adapter(known.load, known.ckpt_step)
    if adapter is not None:
        export_adapter(adapter, known.output_dir, known.hf_checkpoint, known.merge_lora, known.dtype)
        return
    if known.merge_lora:
        parser.error(f"--merge-lora: the checkpoint under --load {known.load} holds no LoRA adapter")
    # Imported here: megatron-core is only needed for Megatron checkpoints.
    from slime.backends.megatron_utils.standalone import export_checkpoint_to_hf, megatron_flags, model_args

    args = model_args(known.hf_checkpoint, megatron_flags(rest))
    export_checkpoint_to_hf(
        args, known.load, known.output_dir, known.hf_checkpoint, known.model_name, known.dtype, known.ckpt_step
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
