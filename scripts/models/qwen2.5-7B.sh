# Qwen2.5-7B (HF: Qwen/Qwen2.5-7B[-Instruct]). q/k/v have biases; separate output layer.
# Source this, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --num-layers 28
   --hidden-size 3584
   --ffn-hidden-size 18944
   --num-attention-heads 28
   --group-query-attention
   --num-query-groups 4
   --kv-channels 128
   --swiglu
   --disable-bias-linear
   --add-qkv-bias
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --rotary-base 1000000
   --max-position-embeddings 32768
   --untie-embeddings-and-output-weights
   --vocab-size 152064
)
