#!/usr/bin/env bash
# Solver + reviewer GRPO (examples/multi_agent/README.md). By default the CPU quickstart's model and
# addition set; MODEL=... DATA=... pick others, and any extra flags go to train.py (GPU flags included).
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
# Ray workers import agent_system by this path, so it must be absolute.
export PYTHONPATH="$PWD/examples/multi_agent${PYTHONPATH:+:$PYTHONPATH}"

ARGS=(
    --hf-checkpoint "$MODEL"
    --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
    --custom-generate-function-path agent_system.generate
    --custom-rm-path agent_system.reward_func --rm-type last_number
    --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "${NUM_ROLLOUT:-20}"
    --rollout-max-response-len 32 --rollout-temperature 0.7
    --advantage-estimator grpo --lr 2e-5
    --save "${OUT:-outputs/multi-agent}" --save-debug-rollout-data "${OUT:-outputs/multi-agent}/rollouts/rollout_{rollout_id}.pt"
)
python3 train.py "${ARGS[@]}" "$@"
