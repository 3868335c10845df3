#!/usr/bin/env bash
# SFT of Qwen3-4B-Base on chat data (e.g. OpenHermes-2.5 as a parquet with a `messages` column).
# No engines: the rollout function reads the dataset instead of generating (--debug-train-only),
# the loss is token-averaged cross-entropy on assistant tokens. train_async.py prefetches the
# next batch while the current one trains. DRY_RUN=1 prints the training arguments instead.
# Multi-turn data: Qwen3's chat template gives only the final assistant turn a <think></think> block,
# so conversations with several assistant turns are refused; keep one assistant turn per record.
#
# Before the first run:
#   hf download Qwen/Qwen3-4B-Base --local-dir $ROOT_DIR/Qwen3-4B-Base
#   source scripts/models/qwen3-4B.sh
#   python tools/convert_hf_to_torch_dist.py "${MODEL_ARGS[@]}" \
#       --hf-checkpoint $ROOT_DIR/Qwen3-4B-Base --save $ROOT_DIR/Qwen3-4B-Base_torch_dist
set -euo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/qwen3-4B.sh"
ROOT_DIR="${ROOT_DIR:-/root}"
NUM_GPUS="${NUM_GPUS:-8}"

CKPT_ARGS=(
   --hf-checkpoint "${ROOT_DIR}/Qwen3-4B-Base"
   --ref-load "${ROOT_DIR}/Qwen3-4B-Base_torch_dist"
   --load "${ROOT_DIR}/Qwen3-4B-Base_sft/"
   --save "${ROOT_DIR}/Qwen3-4B-Base_sft/"
   --save-interval 1000
)

SFT_ARGS=(
   --rollout-function-path slime.rollout.sft_rollout.generate_rollout
   --prompt-data "${ROOT_DIR}/openhermes2_5.parquet"
   --input-key messages
   --rollout-shuffle
   --num-epoch 3
   # one batch read = one optimizer step
   --rollout-batch-size 128
   --global-batch-size 128
   --loss-type sft_loss
   --calculate-per-token-loss
   --disable-compute-advantages-and-returns
   --debug-train-only
)

PERF_ARGS=(
   --tensor-model-parallel-size 1
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-5
   --lr-warmup-iters 128
   --lr-decay-style cosine
   --min-lr 1e-6
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
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
   "${MODEL_ARGS[@]}"
   "${CKPT_ARGS[@]}"
   "${SFT_ARGS[@]}"
   "${PERF_ARGS[@]}"
   "${OPTIMIZER_ARGS[@]}"
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
   -- python3 train_async.py "${TRAIN_ARGS[@]}"
