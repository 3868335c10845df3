#!/usr/bin/env bash
# GRPO on a coding agent written against the anthropic client (examples/coding_agent_rl/README.md): the model
# writes Python, the local sandbox runs the problem's tests on it, the reward is the share that pass. By default
# the CPU quickstart's model and the shipped problems; MODEL=... DATA=... pick others, and any extra flags go to
# train.py (GPU flags included).
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct}
DATA=${DATA:-examples/coding_agent_rl/problems.jsonl}
OUT=${OUT:-outputs/coding_agent_rl}
for path in "$MODEL" "$DATA"; do
    if [ ! -e "$path" ]; then
        echo "$path does not exist: run bash scripts/run-quickstart-cpu.sh once (it prepares the model), or pass MODEL=... DATA=..." >&2
        exit 1
    fi
done
# Ray workers import agent.py by this path, so it must be absolute.
export PYTHONPATH="$PWD/examples/coding_agent_rl${PYTHONPATH:+:$PYTHONPATH}"

ARGS=(
    --hf-checkpoint "$MODEL"
    --prompt-data "$DATA" --input-key prompt --label-key label --rollout-shuffle
    --agent-function-path agent.run --custom-rm-path agent.reward_func
    --max-turns "${MAX_TURNS:-3}" --rollout-max-response-len 256 --rollout-max-context-len 2048
    --rollout-batch-size 4 --n-samples-per-prompt 4 --num-rollout "${NUM_ROLLOUT:-20}" --rollout-temperature 0.8
    --advantage-estimator grpo --lr 2e-5
    --train-num-threads 2 --cpu-engine-num-threads 1
    --save "$OUT"
)
python3 train.py "${ARGS[@]}" "$@"
