# GLM-4-9B-0414 (HF: THUDM/GLM-4-9B-0414, model_type glm4). Rotary on half of each head, interleaved;
# extra norms after attention and after the MLP. megatron-core's own layer specs have no such norms,
# so --spec names slime's GLM-4 layer spec (slime/plugins/models/glm4.py), which adds them.
# Source this, then pass "${MODEL_ARGS[@]}".
MODEL_ARGS=(
   --spec slime.plugins.models.glm4 get_glm_spec
   --num-layers 40
   --hidden-size 4096
   --ffn-hidden-size 13696
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 2
   --kv-channels 128
   --swiglu
   --disable-bias-linear
   --add-qkv-bias
   --post-self-attn-layernorm
   --post-mlp-layernorm
   --normalization RMSNorm
   --norm-epsilon 1e-5
   --position-embedding-type rope
   --rotary-base 10000
   --rotary-percent 0.5
   --rotary-interleaved
   --no-rope-fusion
   --max-position-embeddings 32768
   --untie-embeddings-and-output-weights
   --vocab-size 151552
)
