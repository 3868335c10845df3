# DeepSeek-V3 / R1 (HF: deepseek-ai/DeepSeek-V3): multi-latent attention, 61 layers (first 3 dense),
# 256 routed experts (8 per token, sigmoid scores with bias, 8 groups / top-4 groups) + 1 shared expert.
# MODEL_ARGS_NUM_LAYERS shrinks the model for debugging. Source this, then pass "${MODEL_ARGS[@]}".
NUM_LAYERS="${MODEL_ARGS_NUM_LAYERS:-61}"
FIRST_DENSE_LAYERS=3

MODEL_ARGS=(
   --num-layers "${NUM_LAYERS}"
   --hidden-size 7168
   --ffn-hidden-size 18432
   --num-attention-heads 128
   --kv-channels 128
   --swiglu
   --disable-bias-linear
   --normalization RMSNorm
   --norm-epsilon 1e-6
   --position-embedding-type rope
   --untie-embeddings-and-output-weights
   --max-position-embeddings 163840
   --vocab-size 129280

   # MLA with YaRN rope (factor 40 over 4096 positions)
   --multi-latent-attention
   --q-lora-rank 1536
   --kv-lora-rank 512
   --qk-head-dim 128
   --qk-pos-emb-head-dim 64
   --v-head-dim 128
   --qk-layernorm
   --rotary-base 10000
   --rotary-scaling-factor 40
   --original-max-position-embeddings 4096
   --mscale 1.0
   --mscale-all-dim 1.0
   --attention-softmax-in-fp32

   # MoE
   --num-experts 256
   --moe-layer-freq "([0]*${FIRST_DENSE_LAYERS}+[1]*$((NUM_LAYERS - FIRST_DENSE_LAYERS)))"
   --moe-ffn-hidden-size 2048
   --moe-shared-expert-intermediate-size 2048
   --moe-router-topk 8
   --moe-router-score-function sigmoid
   --moe-router-pre-softmax
   --moe-router-enable-expert-bias
   --moe-router-bias-update-rate 0
   --moe-router-topk-scaling-factor 2.5
   --moe-router-num-groups 8
   --moe-router-group-topk 4
   --moe-router-load-balancing-type seq_aux_loss
   --moe-aux-loss-coeff 0
   --moe-router-dtype fp32
   --moe-token-dispatcher-type alltoall
   --moe-grouped-gemm
   --moe-permute-fusion
)
