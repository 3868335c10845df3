# Qwen3-0.6B (HF: Qwen/Qwen3-0.6B). Megatron model flags; source this, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --num-layers 28
   --hidden-size 1024
   --ffn-hidden-size 3072
   --num-attention-heads 16
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
   --vocab-size 151936
)
