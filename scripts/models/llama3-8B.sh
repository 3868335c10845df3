# Llama 3 8B (HF: meta-llama/Meta-Llama-3-8B[-Instruct]). For Llama 3.1 add
# --use-rope-scaling --rope-scaling-factor 8.0 and --max-position-embeddings 131072.
# Source this, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --num-layers 32
   --hidden-size 4096
   --ffn-hidden-size 14336
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --kv-channels 128
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --position-embedding-type rope
   --rotary-base 500000
   --max-position-embeddings 8192
   --untie-embeddings-and-output-weights
   --vocab-size 128256
)
