# Qwen3-30B-A3B (HF: Qwen/Qwen3-30B-A3B): 48 MoE layers, 128 experts, 8 routed per token.
# Source this, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --num-layers 48
   --hidden-size 2048
   --ffn-hidden-size 6144
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --qk-layernorm
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --rotary-base 1000000
   --max-position-embeddings 40960
   --untie-embeddings-and-output-weights
   --vocab-size 151936

   # MoE: softmax over all experts, top-8, renormalized (norm_topk_prob) = top-8 then softmax.
   --num-experts 128
   --moe-layer-freq "([1]*48)"
   --moe-ffn-hidden-size 768
   --moe-router-topk 8
   --moe-router-score-function softmax
   --moe-router-dtype fp32
   --moe-aux-loss-coeff 0
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
