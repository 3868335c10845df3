# Moonlight-16B-A3B (HF: moonshotai/Moonlight-16B-A3B[-Instruct], model_type deepseek_v3):
# MLA without a q low-rank projection, 27 layers (first dense), 64 routed experts (6 per token) +
# 2 shared experts, no rope scaling. Source this, then pass "${MODEL_ARGS[@]}".
NUM_LAYERS=27
FIRST_DENSE_LAYERS=1
EXPERT_FFN=1408
SHARED_EXPERTS=2

MODEL_ARGS=(
   --num-layers ${NUM_LAYERS}
   --hidden-size 2048
   --ffn-hidden-size 11264
   --num-attention-heads 16
   --kv-channels 128
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --position-embedding-type rope
   --untie-embeddings-and-output-weights
   --max-position-embeddings 8192
   --vocab-size 163840

   --multi-latent-attention
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --rope-type rope
   --rotary-base 50000
   --attention-softmax-in-fp32
   --no-rope-fusion

   --num-experts 64
   --moe-layer-freq "([0]*${FIRST_DENSE_LAYERS}+[1]*$((NUM_LAYERS - FIRST_DENSE_LAYERS)))"
   --moe-ffn-hidden-size ${EXPERT_FFN}
   --moe-shared-expert-intermediate-size $((EXPERT_FFN * SHARED_EXPERTS))
   --moe-router-topk 6
   --moe-router-score-function sigmoid
   --moe-router-pre-softmax
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 2.446
   --moe-router-num-groups 1
   --moe-router-group-topk 1
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-router-dtype fp32
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
