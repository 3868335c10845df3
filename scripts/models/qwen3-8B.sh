# Qwen3-8B (HF: Qwen/Qwen3-8B). Source this, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --num-layers 36
   --hidden-size 4096
   --ffn-hidden-size 12288
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --qk-layernorm
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-1000000}"
   --max-position-embeddings 40960
   --untie-embeddings-and-output-weights
   --vocab-size 151936
)
