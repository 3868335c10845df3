#!/usr/bin/env bash
# GRPO on a calculator agent written against the openai client (examples/openai_agent/README.md).
# By default the CPU quickstart's model and addition set; MODEL=... DATA=... pick others, and any extra
# flags go to train.py (GPU flags included).
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
# Ray workers import agent.py and reward.py by this path, so it must be absolute.
export PYTHONPATH="$PWD/examples/openai_agent${PYTHONPATH:+:$PYTHONPATH}"

ARGS=(
    --hf-checkpoint "$MODEL"
    # No --apply-chat-template: the agent sends chat messages and the trajectory proxy templates them.
    --prompt-data "$DATA" --input-key prompt --label-key label --rollout-shuffle
    --agent-function-path agent.run --custom-rm-path reward.reward_func
    --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "${NUM_ROLLOUT:-20}"
    --rollout-max-response-len 64 --rollout-temperature 0.7
    --advantage-estimator grpo --lr 2e-5
    --save "${OUT:-outputs/openai-agent}" --save-debug-rollout-data "${OUT:-outputs/openai-agent}/rollouts/rollout_{rollout_id}.pt"
)
python3 train.py "${ARGS[@]}" "$@"
