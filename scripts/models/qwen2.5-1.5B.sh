# Qwen2.5-1.5B (HF: Qwen/Qwen2.5-1.5B[-Instruct], also DeepSeek-R1-Distill-Qwen-1.5B with its own
# vocabulary/rope: check its config). q/k/v have biases; embeddings are tied.
# Source this, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --num-layers 28
   --hidden-size 1536
   --ffn-hidden-size 8960
   --num-attention-heads 12
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --swiglu
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --rotary-base 1000000
   --max-position-embeddings 32768
   --vocab-size 151936
)
