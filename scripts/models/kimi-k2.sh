# Kimi K2 (HF: moonshotai/Kimi-K2-Instruct, model_type kimi_k2 = DeepSeek-V3 layout): 61 layers
# (first dense), 64 heads, 384 routed experts (8 per token) + 1 shared, YaRN factor 32.
# Source this, then pass "${MODEL_ARGS[@]}".
NUM_LAYERS=61
FIRST_DENSE_LAYERS=1

MODEL_ARGS=(
   --num-layers ${NUM_LAYERS}
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 64
   --kv-channels 128
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --untie-embeddings-and-output-weights
   --max-position-embeddings 131072
   --vocab-size 163840

   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --rotary-base 50000
   --rotary-scaling-factor 32
   --original-max-position-embeddings 4096
   --mscale 1.0
   --mscale-all-dim 1.0
   --beta-fast 1
   --beta-slow 1
   --attention-softmax-in-fp32
   --no-rope-fusion

   --num-experts 384
   --moe-layer-freq "([0]*${FIRST_DENSE_LAYERS}+[1]*$((NUM_LAYERS - FIRST_DENSE_LAYERS)))"
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-pre-softmax
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 2.827
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-router-dtype fp32
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
