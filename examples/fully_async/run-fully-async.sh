#!/usr/bin/env bash
# Fully asynchronous GRPO (examples/fully_async/README.md): the engine generates all the time while the
# trainer trains, no sample more than MAX_STALENESS weight pushes behind. By default the CPU quickstart's model
# and addition set, one core for the trainer and one for the engine; MODEL=... DATA=... pick others, and any
# extra flags go to train_async.py (GPU flags included).
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct}
DATA=${DATA:-data/addition/train.jsonl}
OUT=${OUT:-outputs/fully-async}
for path in "$MODEL" "$DATA"; do
    if [ ! -e "$path" ]; then
        echo "$path does not exist: run bash scripts/run-quickstart-cpu.sh once (it prepares both), or pass MODEL=... DATA=..." >&2
        exit 1
    fi
done

ARGS=(
    --hf-checkpoint "$MODEL"
    --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
    --rm-type last_number
    --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async
    --max-weight-staleness "${MAX_STALENESS:-1}" --staleness-policy drop
    --update-weights-interval 1
    --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "${NUM_ROLLOUT:-30}"
    --rollout-max-response-len 32 --rollout-temperature 0.5
    --advantage-estimator grpo --lr 2e-5 --use-tis
    --use-dynamic-batch-size --max-tokens-per-gpu 4096
    --save "$OUT" --save-interval 10 --save-debug-rollout-data "$OUT/rollouts/rollout_{rollout_id}.pt"
    --train-num-threads 1 --cpu-engine-num-threads 1
)
python3 train_async.py "${ARGS[@]}" "$@"
