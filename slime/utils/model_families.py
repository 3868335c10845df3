"""Model families the Megatron backend does not build yet, and why (the FSDP trainer and the CPU engine run every
transformers causal LM, these included); the families whose MTP layers it trains."""

from __future__ import annotations

# HF model_types with DeepSeek sparse attention (`--freeze-indexer` applies to them).
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

_GATED_DELTA_NET = "gated delta-net linear-attention layers"
_DSA = "DeepSeek sparse attention (DSA) with its lightning indexer"

# HF model_type -> the layers megatron-core (and slime's plugins) cannot build yet.
MEGATRON_NOT_BUILT = {
    "qwen3_next": _GATED_DELTA_NET,
    "qwen3_5": _GATED_DELTA_NET,
    "qwen3_5_text": _GATED_DELTA_NET,
    "qwen3_5_moe": _GATED_DELTA_NET,
    "qwen3_5_moe_text": _GATED_DELTA_NET,
    **dict.fromkeys(DSA_MODEL_TYPES, _DSA),
    "minimax_m2": "q/k RMSNorms over all heads at once (megatron-core normalizes each head on its own)",
    "gpt_oss": "attention sinks, sliding-window layers and biased, clamped SwiGLU experts",
}


def megatron_refusal(model_type: str) -> str | None:
    """Why `--train-backend megatron` cannot train an HF `model_type`, with what to do instead; None if it can (or
    the family is unknown here: the Megatron converter then names what it supports)."""
    layers = MEGATRON_NOT_BUILT.get(model_type)
    if layers is None:
        return None
    return (
        f"slime's Megatron backend does not build {model_type} models yet: they have {layers}. Train them with "
        "--train-backend fsdp (the FSDP trainer and the CPU engine run every transformers causal LM)"
    )


# HF model_types whose checkpoints carry multi-token-prediction layers that the Megatron converter maps (DeepSeek-V3
# and GLM-4.5 as extra decoder layers, MiMo as `mtp_layers`); their configs count them in `num_nextn_predict_layers`.
MTP_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "glm4_moe", "mimo")
