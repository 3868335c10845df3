# GLM-4.5 (HF: zai-org/GLM-4.5; GLM-4.6 / 4.7 share the shapes): GQA attention with QKV bias, q/k norms and
# rotary on half of each head, 92 layers (first 3 dense), 160 routed experts (8 per token, sigmoid scores with
# bias, x2.5) + 1 shared expert. MODEL_ARGS_NUM_LAYERS shrinks the model for debugging.
# Source this, then pass "${MODEL_ARGS[@]}".
NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-92}"
FIRST_DENSE_LAYERS=3

MODEL_ARGS=(
   --num-layers "${NUM_LAYERS}"
   --hidden-size 5120
   --ffn-hidden-size 12288
   --num-attention-heads 96
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --swiglu
   --disable-bias-linear
   --add-qkv-bias
   --qk-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --position-embedding-type rope
   --rotary-percent 0.5
   --rotary-base 1000000
   --untie-embeddings-and-output-weights
   --max-position-embeddings 131072
   --vocab-size 151552

   # MoE
   --num-experts 160
   --moe-layer-freq "([0]*${FIRST_DENSE_LAYERS}+[1]*$((NUM_LAYERS - FIRST_DENSE_LAYERS)))"
   --moe-ffn-hidden-size 1536
   --moe-shared-expert-intermediate-size 1536
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-pre-softmax
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 2.5
   --moe-router-dtype fp32
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
)
