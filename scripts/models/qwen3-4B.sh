# Qwen3-4B (HF: Qwen/Qwen3-4B, also Qwen3-4B-Base / -Instruct-2507). Embeddings are tied.
# Source this, then pass "${MODEL_ARGS[@]}". MODEL_ARGS_ROTARY_BASE overrides the rope base
# (Qwen3-4B-Instruct-2507 uses 5000000).
MODEL_ARGS=(
   --num-layers 36
   --hidden-size 2560
   --ffn-hidden-size 9728
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
   --vocab-size 151936
)
