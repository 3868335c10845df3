#!/usr/bin/env bash
# PPO on Qwen3-4B with DAPO-Math-17k: one node of 8 GPUs, colocated. The critic (same architecture,
# value head) shares the actor's GPUs and parallel layout; actor and critic take turns offloading.
# Preparation as in run-qwen3-4B.sh. DRY_RUN=1 prints the training arguments instead of starting Ray.
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/qwen3-4B.sh"
ROOT_DIR="${ROOT_DIR:-/root}"
NUM_GPUS="${NUM_GPUS:-8}"

CKPT_ARGS=(
   --hf-checkpoint "${ROOT_DIR}/Qwen3-4B"
   --ref-load "${ROOT_DIR}/Qwen3-4B_torch_dist"
   --load "${ROOT_DIR}/Qwen3-4B_slime_ppo/"
   --save "${ROOT_DIR}/Qwen3-4B_slime_ppo/"
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
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

PPO_ARGS=(
   --advantage-estimator ppo
   # GAE over tokens; the critic alone trains first so its values are useful to the actor
   --gamma 1.0
   --lambd 1.0
   --num-critic-only-steps 2
   --value-clip 0.2
   --kl-coef 0.00
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --eps-clip 0.2
   --eps-clip-high 0.28
   --normalize-advantages
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
   --sglang-mem-fraction-static 0.6
)

MISC_ARGS=(
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
   "${PPO_ARGS[@]}"
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
