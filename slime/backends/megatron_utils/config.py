"""Megatron model flags -> megatron-core `TransformerConfig`, and an HF `config.json` -> the same flags.

The flags are Megatron-LM's (`scripts/models/*.sh` pass them as `MODEL_ARGS`). slime's parser keeps
them on `args` under Megatron's attribute names (`args.num_layers`, `args.swiglu`, ...), whether
Megatron-LM's own parser read them or slime kept them as typed pass-through values. Every attribute
named like a `TransformerConfig` field is copied as is (as Megatron-LM does); the flags named
differently are translated here.

Model families (for weight-name conversion) are resolved by `resolve_family`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from slime.utils.device import cuda_available
from slime.utils.model_families import megatron_refusal

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4", "glm4_moe", "deepseek_v3", "mimo")

# Accepted spellings (after lower-casing and "-"/"." -> "_") and HF `model_type`s, per family.
_FAMILY_ALIASES = {
    "llama": "llama",
    "llama3": "llama",
    "qwen2": "qwen2",
    "qwen2_5": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3moe": "qwen3_moe",
    "glm4": "glm4",
    "glm4_moe": "glm4_moe",
    "glm4_5": "glm4_moe",
    "glm4_6": "glm4_moe",
    "glm4_7": "glm4_moe",
    "deepseek_v3": "deepseek_v3",
    "deepseekv3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "moonlight": "deepseek_v3",
    "mimo": "mimo",
}

# Megatron-LM parser defaults for the flags read here; slime differs only on dropout (see below).
_DEFAULTS: dict[str, Any] = {
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-5,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "make_vocab_size_divisible_by": 128,
    "init_method_std": 0.02,
    # Megatron-LM defaults to 0.1; HF checkpoints are trained and served without dropout, and RL
    # log-probs must match the engines, so slime defaults to none. Pass --hidden-dropout to change it.
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}


def megatron_flag(args: argparse.Namespace, name: str, default: Any = None) -> Any:
    """`args.<name>`, or `default` when `args` lacks it.

    Megatron's model flags are on `args` only when given (without megatron.training they pass through as
    typed values, `parsing.parse_args`), and the conversion tools build `args` from an HF config
    (`standalone.model_args`), so this module and `model.py` read every Megatron flag through here.
    """
    return getattr(args, name, default)


def resolve_family(name: str) -> str:
    """Map a model family name, alias or HF `model_type` to one of `SUPPORTED_FAMILIES`.

    Args:
        name: e.g. "qwen2.5", "Qwen3-MoE", "deepseek-v3", "kimi_k2", "llama".

    Returns:
        the canonical family, e.g. "qwen2", "qwen3_moe", "deepseek_v3".

    Raises:
        ValueError: naming the family and the supported list.
    """
    key = re.sub(r"[-.\s]", "_", str(name).strip().lower())
    if key in _FAMILY_ALIASES:
        return _FAMILY_ALIASES[key]
    refusal = megatron_refusal(key)
    if refusal:
        raise ValueError(refusal)
    raise ValueError(
        f"unknown model family {name!r}: slime converts weights for {', '.join(SUPPORTED_FAMILIES)} "
        f"(aliases: {', '.join(sorted(set(_FAMILY_ALIASES) - set(SUPPORTED_FAMILIES)))}). "
        "Pass --model-name with one of them, or add a converter for this family."
    )


def load_hf_config(hf_config: Any) -> dict[str, Any]:
    """An HF config as a plain dict, from a folder, a config.json path, a dict or a `PretrainedConfig`."""
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no HF config at {path}; pass an HF model folder that holds config.json")
        return json.loads(path.read_text())
    return hf_config.to_dict()


def family_from_hf_config(hf_config: Any) -> str:
    """The model family of an HF config (by its `model_type`)."""
    return resolve_family(load_hf_config(hf_config).get("model_type", "<missing model_type>"))


def model_family(args: argparse.Namespace) -> str:
    """The family of the trained model: `--model-name` if given, else the `model_type` of `--hf-checkpoint`."""
    if args.model_name:
        return resolve_family(args.model_name)
    if args.hf_checkpoint:
        return family_from_hf_config(args.hf_checkpoint)
    raise ValueError("cannot tell the model family: pass --model-name (e.g. qwen3) or --hf-checkpoint")


def _rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling dict or None) from old-style `rope_theta`/`rope_scaling` or new `rope_parameters`."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return theta, (None if rope_type in (None, "default") else {**scaling, "rope_type": rope_type})


def _partial_rotary_factor(config: dict[str, Any], family: str) -> float:
    """Share of each head that is rotated: top level in hub configs, inside `rope_parameters` in transformers 5."""
    params = config.get("rope_parameters") or {}
    # GLM-4 configs may omit it; transformers' Glm4Config / Glm4MoeConfig then rotate half of each head.
    default = 0.5 if family in ("glm4", "glm4_moe") else 1.0
    return float(config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or default)


def _deepseek_style_moe(c: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's MoE (GLM-4.5 has it too): the first `first_k_dense_replace` layers dense, then sigmoid-scored
    routed experts picked with a bias (noaux_tc) within the best groups, weighted by their normalized scores times
    `routed_scaling_factor`, plus always-on shared experts."""
    first_dense = c.get("first_k_dense_replace", 0)
    return dict(
        num_experts=c["n_routed_experts"],
        moe_router_topk=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=c["moe_intermediate_size"] * c.get("n_shared_experts", 1),
        moe_layer_freq=[0] * first_dense + [1] * (c["num_hidden_layers"] - first_dense),
        moe_router_score_function=c.get("scoring_func", "sigmoid"),
        moe_router_pre_softmax=True,
        moe_router_enable_expert_bias=c.get("topk_method", "noaux_tc") == "noaux_tc",
        moe_router_topk_scaling_factor=c.get("routed_scaling_factor", 1.0),
        moe_router_num_groups=c.get("n_group", 1),
        moe_router_group_topk=c.get("topk_group", 1),
    )


def config_from_hf(hf_config: Any) -> argparse.Namespace:
    """Derive the Megatron model flags (`MODEL_ARGS`) of an HF model from its config.

    Args:
        hf_config: an HF model folder, config.json path, config dict or `PretrainedConfig`.

    Returns:
        a namespace with Megatron's attribute names (num_layers, swiglu, num_query_groups, ...) plus
        `model_name` (the family). Parallel sizes are not set; add them before building a model.

    Raises:
        ValueError: for a family slime does not support or a feature these flags cannot express.
    """
    c = load_hf_config(hf_config)
    family = resolve_family(c.get("model_type", "<missing model_type>"))
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={c['hidden_act']!r} is not supported; slime's Megatron models use SwiGLU (silu)")
    theta, scaling = _rope_settings(c)
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    flags: dict[str, Any] = dict(
        model_name=family,
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=heads,
        group_query_attention=kv_heads != heads,
        num_query_groups=kv_heads,
        kv_channels=c.get("head_dim") or c["hidden_size"] // heads,
        normalization="RMSNorm",
        norm_epsilon=c.get("rms_norm_eps", 1e-6),
        swiglu=True,
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=_partial_rotary_factor(c, family),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        disable_bias_linear=True,
        add_qkv_bias=family in ("qwen2", "mimo") or bool(c.get("attention_bias", False)),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        vocab_size=c["vocab_size"],
        max_position_embeddings=c.get("max_position_embeddings", 4096),
    )
    if family == "llama" and c.get("mlp_bias"):
        raise ValueError("Llama with mlp_bias=True is not supported (Megatron biases are all-or-nothing)")
    if family == "glm4":
        flags.update(rotary_interleaved=True, post_self_attn_layernorm=True, post_mlp_layernorm=True)
        flags.update(spec=["slime.plugins.models.glm4", "get_glm_spec"])  # a layer spec with those norms
    if scaling is not None and scaling["rope_type"] == "llama3":
        flags.update(use_rope_scaling=True, rope_scaling_factor=scaling["factor"])
    elif scaling is not None and family != "deepseek_v3":
        raise ValueError(f"rope scaling {scaling['rope_type']!r} is not supported for {family}")
    if family == "qwen3_moe":
        every = c.get("decoder_sparse_step", 1)
        dense = set(c.get("mlp_only_layers") or [])
        flags.update(
            # transformers 5 writes `num_local_experts`; hub configs have `num_experts`.
            num_experts=c.get("num_experts") or c["num_local_experts"],
            moe_router_topk=c["num_experts_per_tok"],
            moe_ffn_hidden_size=c["moe_intermediate_size"],
            # top-k then softmax over the k == softmax over all, top-k, renormalize (norm_topk_prob).
            moe_router_pre_softmax=not c.get("norm_topk_prob", True),
            moe_router_score_function="softmax",
            moe_layer_freq=[int(i not in dense and (i + 1) % every == 0) for i in range(c["num_hidden_layers"])],
        )
    if family == "glm4_moe":
        # GLM-4.5/4.6/4.7: GQA attention (rotating the first half of each head, Llama-style), DeepSeek-V3's MoE.
        flags.update(qk_layernorm=bool(c.get("use_qk_norm", False)), **_deepseek_style_moe(c))
    if family == "deepseek_v3":
        flags.update(
            group_query_attention=False,
            num_query_groups=heads,
            kv_channels=c["v_head_dim"],
            multi_latent_attention=True,
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"],
            qk_head_dim=c["qk_nope_head_dim"],
            qk_pos_emb_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"],
            qk_layernorm=True,
            **_deepseek_style_moe(c),
        )
        if scaling is not None:
            flags.update(
                rope_type="yarn",
                rotary_scaling_factor=scaling["factor"],
                mscale=scaling.get("mscale", 1.0),
                mscale_all_dim=scaling.get("mscale_all_dim", 0.0),
                original_max_position_embeddings=scaling.get("original_max_position_embeddings", 4096),
                beta_fast=scaling.get("beta_fast", 32.0),
                beta_slow=scaling.get("beta_slow", 1.0),
            )
        else:
            flags.update(rope_type="rope")
    return argparse.Namespace(**flags)


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_model_parallel_size: int = 1) -> int:
    """Megatron's vocabulary padding: up to a multiple of `divisible_by x tensor_model_parallel_size`."""
    multiple = divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def args_vocab_size(args: argparse.Namespace) -> int:
    """The true (unpadded) vocabulary: `--vocab-size`, else `vocab_size` of `--hf-checkpoint`'s config."""
    if megatron_flag(args, "vocab_size"):
        return int(args.vocab_size)
    if megatron_flag(args, "hf_checkpoint"):
        return int(load_hf_config(args.hf_checkpoint)["vocab_size"])
    raise ValueError("the vocabulary size is unknown: pass --vocab-size or --hf-checkpoint")


def args_padded_vocab_size(args: argparse.Namespace) -> int:
    """`--padded-vocab-size` if given, else the true vocabulary padded the Megatron way."""
    if megatron_flag(args, "padded_vocab_size"):
        return int(args.padded_vocab_size)
    return padded_vocab_size(
        args_vocab_size(args),
        int(megatron_flag(args, "make_vocab_size_divisible_by", _DEFAULTS["make_vocab_size_divisible_by"])),
        int(megatron_flag(args, "tensor_model_parallel_size", 1) or 1),
    )


def _get(args: argparse.Namespace, name: str) -> Any:
    value = megatron_flag(args, name)
    return _DEFAULTS.get(name) if value is None else value


def _switch(args: argparse.Namespace, name: str, off_flag: str, default: bool = True) -> bool:
    """A Megatron on-by-default switch: `args.<name>` from Megatron's parser, or `--<off-flag>` passed through."""
    if isinstance(megatron_flag(args, name), bool):
        return megatron_flag(args, name)
    return default and not megatron_flag(args, off_flag, False)


def parse_layer_freq(value: Any) -> int | list[int]:
    """`--moe-layer-freq`: an int, a list, or Megatron's string form like "([0]*3+[1]*58)".

    Raises:
        ValueError: for any other string, naming the accepted forms.
    """
    if isinstance(value, (int, list)):
        return value
    text = str(value).strip().strip("'\"").strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    if re.fullmatch(r"\d+", text):
        return int(text)
    pattern = r"\[(\d+(?:\s*,\s*\d+)*)\]\s*\*\s*(\d+)"
    if re.fullmatch(rf"{pattern}(\s*\+\s*{pattern})*", text):
        freq: list[int] = []
        for items, count in re.findall(pattern, text):
            freq += [int(x) for x in items.split(",")] * int(count)
        return freq
    if text.startswith("["):
        return [int(x) for x in json.loads(text)]
    raise ValueError(f"--moe-layer-freq {value!r}: use an int, a list like [0,1,1] or a form like ([0]*3+[1]*58)")


def te_available() -> bool:
    """TransformerEngine importable and a GPU present: then the TE layer spec and fusions are used."""
    return cuda_available() and importlib.util.find_spec("transformer_engine") is not None


def use_transformer_engine(args: argparse.Namespace) -> bool:
    """Whether to build with TransformerEngine (`--transformer-impl local` forces the local spec)."""
    return megatron_flag(args, "transformer_impl", "transformer_engine") != "local" and te_available()


def transformer_config_from_args(args: argparse.Namespace):
    """Build the megatron-core `TransformerConfig` (or `MLATransformerConfig`) from Megatron flags.

    Args:
        args: Megatron attribute names as set by slime's parser or `config_from_hf`; parallel sizes
            default to 1 when absent.

    Returns:
        the config; fp32 parameters unless --bf16/--fp16; CUDA-only fusions off without TE and CUDA.
    """
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    mla = bool(megatron_flag(args, "multi_latent_attention", False))
    config_class = MLATransformerConfig if mla else TransformerConfig
    fields = {f.name for f in dataclasses.fields(config_class)}
    # Same rule as Megatron-LM: attributes named like a field are taken as they are.
    kwargs = {name: megatron_flag(args, name) for name in fields if megatron_flag(args, name) is not None}

    heads = args.num_attention_heads
    swiglu = bool(megatron_flag(args, "swiglu", False))
    bf16, fp16 = bool(megatron_flag(args, "bf16", False)), bool(megatron_flag(args, "fp16", False))
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    te = use_transformer_engine(args)
    activation_fusion = "bias_swiglu_fusion" if swiglu else "bias_gelu_fusion"
    gradient_fusion_off = "no_gradient_accumulation_fusion"
    # Megatron-LM's default FFN width: 4h, or 2/3 of it (rounded down to 64) for SwiGLU.
    default_ffn = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * args.hidden_size
    kwargs.update(
        num_query_groups=args.num_query_groups if megatron_flag(args, "group_query_attention", False) else heads,
        kv_channels=megatron_flag(args, "kv_channels") or args.hidden_size // heads,
        ffn_hidden_size=megatron_flag(args, "ffn_hidden_size") or default_ffn,
        normalization=_get(args, "normalization"),
        layernorm_epsilon=float(_get(args, "norm_epsilon")),
        layernorm_zero_centered_gamma=bool(megatron_flag(args, "apply_layernorm_1p", False)),
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=_switch(args, "add_bias_linear", "disable_bias_linear"),
        hidden_dropout=float(_get(args, "hidden_dropout")),
        attention_dropout=float(_get(args, "attention_dropout")),
        init_method_std=float(_get(args, "init_method_std")),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        fp16=fp16,
        tensor_model_parallel_size=megatron_flag(args, "tensor_model_parallel_size", 1) or 1,
        pipeline_model_parallel_size=megatron_flag(args, "pipeline_model_parallel_size", 1) or 1,
        context_parallel_size=megatron_flag(args, "context_parallel_size", 1) or 1,
        expert_model_parallel_size=megatron_flag(args, "expert_model_parallel_size", 1) or 1,
        # Megatron-LM's default: experts split like the dense layers.
        expert_tensor_parallel_size=megatron_flag(args, "expert_tensor_parallel_size")
        or megatron_flag(args, "tensor_model_parallel_size", 1)
        or 1,
        sequence_parallel=bool(megatron_flag(args, "sequence_parallel", False)),
        use_cpu_initialization=not cuda_available(),
        # Fused kernels need CUDA (and most need TE); off otherwise.
        bias_activation_fusion=te and _switch(args, activation_fusion, "no_" + activation_fusion),
        bias_dropout_fusion=te and _switch(args, "bias_dropout_fusion", "no_bias_dropout_fusion"),
        masked_softmax_fusion=te and _switch(args, "masked_softmax_fusion", "no_masked_softmax_fusion"),
        apply_rope_fusion=te and _switch(args, "apply_rope_fusion", "no_rope_fusion"),
        gradient_accumulation_fusion=te and _switch(args, "gradient_accumulation_fusion", gradient_fusion_off),
        persist_layer_norm=te and not megatron_flag(args, "no_persist_layer_norm", False),
    )
    if megatron_flag(args, "num_layers_per_virtual_pipeline_stage"):
        per_stage = args.num_layers // kwargs["pipeline_model_parallel_size"]
        kwargs["virtual_pipeline_model_parallel_size"] = per_stage // args.num_layers_per_virtual_pipeline_stage
    if megatron_flag(args, "decoder_first_pipeline_num_layers"):
        kwargs["num_layers_in_first_pipeline_stage"] = args.decoder_first_pipeline_num_layers
    if megatron_flag(args, "decoder_last_pipeline_num_layers"):
        kwargs["num_layers_in_last_pipeline_stage"] = args.decoder_last_pipeline_num_layers
    if megatron_flag(args, "num_experts"):
        kwargs["num_moe_experts"] = int(args.num_experts)
        kwargs["moe_layer_freq"] = parse_layer_freq(megatron_flag(args, "moe_layer_freq", 1))
        if not te:  # grouped GEMM and permute/router fusions are TE kernels
            kwargs.update(moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False)
    if isinstance(kwargs.get("attention_backend"), str):
        kwargs["attention_backend"] = AttnBackend[kwargs["attention_backend"]]
    if not te:
        kwargs["attention_backend"] = AttnBackend.local
    if mla:
        kwargs.setdefault("rope_type", "yarn")
        kwargs["rotary_base"] = _get(args, "rotary_base")
        kwargs["rotary_percent"] = float(_get(args, "rotary_percent"))
    return config_class(**kwargs)
