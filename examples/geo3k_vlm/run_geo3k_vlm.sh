#!/bin/bash
# GRPO on a vision-language model (FSDP trainer): count the sides of a drawn polygon or the dots in a picture.
#
#   MODEL=/path/to/Qwen2.5-VL-3B-Instruct bash examples/geo3k_vlm/run_geo3k_vlm.sh [more flags]
#
# MODEL is any local Qwen2.5-VL / Qwen3-VL folder (weights, tokenizer, preprocessor_config.json). On a machine
# without CUDA slime picks the CPU engine and the gloo FSDP trainer itself; on GPUs add the placement flags (see
# examples/geo3k_vlm/README.md). Any flag given after the script's overrides the recipe's.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:?set MODEL to a vision-language HF folder}
DATA=${DATA:-data/geo3k_synth}
SAVE=${SAVE:-outputs/geo3k-vlm}

[ -f "$DATA/train.jsonl" ] || python examples/geo3k_vlm/synth_data.py --out "$DATA"

python train.py \
    --hf-checkpoint "$MODEL" \
    --train-backend fsdp \
    --prompt-data "$DATA/train.jsonl" --input-key problem --label-key answer \
    --multimodal-keys '{"image": "images"}' --apply-chat-template --rollout-shuffle \
    --rm-type math \
    --num-rollout 40 --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 96 \
    --rollout-temperature 1.0 \
    --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
    --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 \
    --eval-prompt-data geo3k_synth "$DATA/test.jsonl" --eval-interval 10 \
    --save "$SAVE" --save-interval 20 \
    "$@"
