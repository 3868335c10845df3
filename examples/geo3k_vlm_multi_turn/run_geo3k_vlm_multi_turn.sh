#!/bin/bash
# Multi-turn GRPO on a vision-language model (FSDP trainer): count the sides of a drawn polygon or the dots in a
# picture; a wrong answer gets a zoomed picture back and the model answers again (examples/geo3k_vlm_multi_turn).
#
#   MODEL=/path/to/Qwen2.5-VL-3B-Instruct bash examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn.sh [more flags]
#
# MODEL is any local Qwen2.5-VL / Qwen3-VL folder (weights, tokenizer, preprocessor_config.json). Without CUDA slime
# picks the CPU engine and the gloo FSDP trainer; on GPUs add the placement flags (README). Any flag given after the
# script's overrides the recipe's.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:?set MODEL to a vision-language HF folder}
DATA=${DATA:-data/geo3k_synth}
SAVE=${SAVE:-outputs/geo3k-vlm-multi-turn}

[ -f "$DATA/train.jsonl" ] || python examples/geo3k_vlm/synth_data.py --out "$DATA"
# Ray workers import rollout.py and env_geo3k.py by this path, so it must be absolute.
export PYTHONPATH="$PWD/examples/geo3k_vlm_multi_turn${PYTHONPATH:+:$PYTHONPATH}"

python train.py \
    --hf-checkpoint "$MODEL" \
    --train-backend fsdp \
    --prompt-data "$DATA/train.jsonl" --input-key problem --label-key answer \
    --multimodal-keys '{"image": "images"}' --apply-chat-template --rollout-shuffle \
    --custom-generate-function-path rollout.generate --max-turns 3 \
    --rm-type math \
    --num-rollout 40 --rollout-batch-size 4 --n-samples-per-prompt 4 \
    --rollout-max-response-len 96 --rollout-max-context-len 1024 \
    --rollout-temperature 1.0 \
    --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
    --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 \
    --save "$SAVE" --save-interval 20 \
    "$@"
