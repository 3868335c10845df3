"""Convert an HF checkpoint into a Megatron torch_dist checkpoint (for --load / --ref-load).

The model flags default to the ones derived from the HF config.json; Megatron flags given on the
command line (e.g. a `MODEL_ARGS` array) override them. The result is `SAVE/iter_0000000` plus
`SAVE/latest_checkpointed_iteration.txt`, loadable under any TP/PP/EP layout. The folder is written
beside SAVE and renamed into place; an existing SAVE is replaced only if it is an earlier slime output.

Usage:
    source scripts/models/qwen3-4B.sh
    python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint /root/Qwen3-4B --save /root/Qwen3-4B_torch_dist
    # large models: split the work over GPUs
    torchrun --nproc-per-node 8 tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} \\
        --tensor-model-parallel-size 8 --hf-checkpoint ... --save ...

Without CUDA it runs on the CPU with gloo (fine for small models).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch.distributed as dist

from slime.backends.megatron_utils.checkpoint import save_checkpoint
from slime.backends.megatron_utils.config import resolve_family
from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights, unused_hf_weights
from slime.backends.megatron_utils.model import build_model
from slime.backends.megatron_utils.standalone import init_distributed, megatron_flags, model_args, shutdown
from slime.utils.atomic_dir import check_replaceable, create_staging, on_rank0, publish

logger = logging.getLogger("convert_hf_to_torch_dist")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-checkpoint", required=True, help="HF model folder (config.json + safetensors).")
    parser.add_argument("--save", required=True, help="Output directory for the torch_dist checkpoint.")
    parser.add_argument("--model-name", default=None, help="Model family (default: the config's model_type).")
    known, rest = parser.parse_known_args(argv)

    args = model_args(known.hf_checkpoint, megatron_flags(rest))
    family = resolve_family(known.model_name or args.model_name)
    save = Path(known.save).absolute()
    check_replaceable(save, "--save")  # before any work
    init_distributed(args)
    model = build_model(args, wrap_with_ddp=False)
    used = load_hf_weights(model, known.hf_checkpoint, family, progress=True)

    everything_used: list[set[str]] = [set() for _ in range(dist.get_world_size())]
    dist.all_gather_object(everything_used, used)
    unused = unused_hf_weights(known.hf_checkpoint, set().union(*everything_used))
    if unused and dist.get_rank() == 0:
        logger.warning("%d HF tensors were not converted (not in this model): %s", len(unused), unused[:10])

    staging = on_rank0(create_staging, save, "torch-dist", "--save")
    final_dir = save_checkpoint(staging, 0, model)
    if dist.get_rank() == 0:
        publish(staging, save, "torch-dist", "--save")
        print(f"saved {save / final_dir.name}")
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
