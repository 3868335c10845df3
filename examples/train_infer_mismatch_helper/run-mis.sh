#!/usr/bin/env bash
# GRPO with the train/inference mismatch measured and corrected (MIS + TIS, mis.yaml); see README.md.
# By default the CPU quickstart's model and addition set; MODEL=... DATA=... pick others, and any extra
# flags go to train.py (GPU flags included; flags after mis.yaml's keys do not override them: edit the YAML).
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct}
DATA=${DATA:-data/addition/train.jsonl}
for path in "$MODEL" "$DATA"; do
    if [ ! -e "$path" ]; then
        echo "$path does not exist: run bash scripts/run-quickstart-cpu.sh once (it prepares both), or pass MODEL=... DATA=..." >&2
        exit 1
    fi
done
# Ray workers import mis.py by this path, so it must be absolute.
export PYTHONPATH="$PWD/examples/train_infer_mismatch_helper${PYTHONPATH:+:$PYTHONPATH}"

ARGS=(
    --hf-checkpoint "$MODEL"
    --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
    --rm-type last_number
    --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "${NUM_ROLLOUT:-20}"
    --rollout-max-response-len 32 --rollout-temperature 1.0
    --advantage-estimator grpo --lr 2e-5
    --custom-config-path examples/train_infer_mismatch_helper/mis.yaml
    --save "${OUT:-outputs/mis}"
)
python3 train.py "${ARGS[@]}" "$@"
