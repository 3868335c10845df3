#!/usr/bin/env bash
# GRPO on Qwen3-4B with DAPO-Math-17k: one node of 8 GPUs, training and rollout colocated
# (they take turns on the same GPUs). Megatron TP=2, SGLang engines of 2 GPUs each.
#
# Before the first run (paths under ROOT_DIR, default /root):
#   hf download Qwen/Qwen3-4B --local-dir $ROOT_DIR/Qwen3-4B
#   source scripts/models/qwen3-4B.sh
#   python tools/convert_hf_to_torch_dist.py "${MODEL_ARGS[@]}" \
#       --hf-checkpoint $ROOT_DIR/Qwen3-4B --save $ROOT_DIR/Qwen3-4B_torch_dist
#   data: $ROOT_DIR/dapo-math-17k/dapo-math-17k.jsonl and $ROOT_DIR/aime-2024/aime-2024.jsonl
#
# DRY_RUN=1 prints the training arguments (one per line) instead of starting Ray.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/qwen3-4B.sh"
ROOT_DIR="${ROOT_DIR:-/root}"
NUM_GPUS="${NUM_GPUS:-8}"

CKPT_ARGS=(
   --hf-checkpoint "${ROOT_DIR}/Qwen3-4B"
   --ref-load "${ROOT_DIR}/Qwen3-4B_torch_dist"
   # Resumes from here when it holds a checkpoint; otherwise training starts from --ref-load.
   --load "${ROOT_DIR}/Qwen3-4B_slime/"
   --save "${ROOT_DIR}/Qwen3-4B_slime/"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "${ROOT_DIR}/dapo-math-17k/dapo-math-17k.jsonl"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   # 32 prompts x 8 samples = 256 samples = one optimizer step of 256
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --global-batch-size 256
   --rollout-max-response-len 8192
   --rollout-temperature 1.0
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime "${ROOT_DIR}/aime-2024/aime-2024.jsonl"
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 1.0
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   # pack micro-batches up to this many tokens instead of a fixed micro-batch size
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
)

MISC_ARGS=(
   # Megatron-LM's dropout default is 0.1; RL wants the same function as the engines.
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

TRAIN_ARGS=(
   --train-backend megatron
   --actor-num-nodes 1
   --actor-num-gpus-per-node "${NUM_GPUS}"
   --colocate
   "${MODEL_ARGS[@]}"
   "${CKPT_ARGS[@]}"
   "${ROLLOUT_ARGS[@]}"
   "${EVAL_ARGS[@]}"
   "${PERF_ARGS[@]}"
   "${GRPO_ARGS[@]}"
   "${OPTIMIZER_ARGS[@]}"
   "${SGLANG_ARGS[@]}"
   "${MISC_ARGS[@]}"
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
   printf '%s\n' "${TRAIN_ARGS[@]}"
   exit 0
fi

export MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
ray start --head --node-ip-address "${MASTER_ADDR}" --num-gpus "${NUM_GPUS}" --disable-usage-stats
ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"env_vars": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}' \
   -- python3 train.py "${TRAIN_ARGS[@]}"
