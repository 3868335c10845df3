# Qwen2.5-0.5B (HF: Qwen/Qwen2.5-0.5B[-Instruct]). q/k/v have biases; embeddings are tied.
# Source this, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --num-layers 24
   --hidden-size 896
   --ffn-hidden-size 4864
   --num-attention-heads 14
   --group-query-attention
   --num-query-groups 2
   --kv-channels 64
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
