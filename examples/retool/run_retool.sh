#!/usr/bin/env bash
# ReTool GRPO (examples/retool/README.md): multi-turn math with a sandboxed Python interpreter. By default on CPU
# with the quickstart's model and the shipped problems; MODEL=... DATA=... pick others, and any extra flags go to
# train.py (GPU flags included: they override the script's).
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct}
DATA=${DATA:-examples/retool/math.jsonl}
OUT=${OUT:-outputs/retool}
for path in "$MODEL" "$DATA"; do
    if [ ! -e "$path" ]; then
        echo "$path does not exist: run bash scripts/run-quickstart-cpu.sh once (it prepares the model), or pass MODEL=... DATA=..." >&2
        exit 1
    fi
done
# Ray workers import generate_with_retool by this path, so it must be absolute.
export PYTHONPATH="$PWD/examples/retool${PYTHONPATH:+:$PYTHONPATH}"

ARGS=(
    --hf-checkpoint "$MODEL"
    --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
    --custom-generate-function-path generate_with_retool.generate
    --custom-rm-path generate_with_retool.reward_func
    --max-turns "${MAX_TURNS:-3}" --rollout-max-response-len 128 --rollout-max-context-len 1536
    --rollout-batch-size 4 --n-samples-per-prompt 4 --num-rollout "${NUM_ROLLOUT:-20}" --rollout-temperature 0.8
    --advantage-estimator grpo --lr 2e-5
    --train-num-threads 2 --cpu-engine-num-threads 1
    --save "$OUT" --save-debug-rollout-data "$OUT/rollouts/rollout_{rollout_id}.pt"
)
python3 train.py "${ARGS[@]}" "$@"
