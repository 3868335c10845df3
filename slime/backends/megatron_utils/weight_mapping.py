"""Parameter names and layouts: megatron-core GPT <-> HF checkpoints, per model family.

Both directions use one table per family, so they cannot drift apart. A Megatron name here is a
*global, full* name: no `module.` wrapper prefixes, the global layer number (pipeline offset added),
the global expert number, and the whole tensor (tensor-parallel shards gathered). Both spellings of
the layer norms are accepted: TE's fused `...linear_qkv.layer_norm_weight` and the local spec's
`input_layernorm.weight`.

Layouts that differ between the two:
- QKV: Megatron fuses q, k and v per query group, `[group][q heads of the group, k, v][head_dim]`;
  HF keeps q_proj / k_proj / v_proj (k/v head g serves q heads g*rep .. g*rep+rep-1).
- SwiGLU: Megatron's `linear_fc1` is `[gate; up]`; HF has gate_proj and up_proj (GLM4 keeps
  them fused as `gate_up_proj`, same order).
- Vocabulary: Megatron pads the embedding / output rows; the extra rows are dropped for HF.
- MiMo MTP `eh_proj` takes its two input halves in the opposite order to HF's `input_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slime.backends.megatron_utils.config import resolve_family

COPY, QKV, GATE_UP, VOCAB, SWAP_HALVES = "copy", "qkv", "gate_up", "vocab", "swap_halves"


@dataclass(frozen=True)
class ModelDims:
    """What name and layout conversion needs to know about a model."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # the true (HF) vocabulary, without Megatron's padding
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, config, family: str, vocab_size: int, tied_embeddings: bool = False) -> ModelDims:
        """From a megatron-core `TransformerConfig`."""
        return cls(
            family=resolve_family(family),
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups or config.num_attention_heads,
            head_dim=config.kv_channels,
            vocab_size=vocab_size,
            tied_embeddings=tied_embeddings,
        )


# (Megatron name pattern after "decoder.layers.{L}.", HF names after "model.layers.{L}.", kind).
# A captured group in the pattern is an expert number, written as {E} in the HF names.
Rule = tuple[str, tuple[str, ...], str]

_NORMS: list[Rule] = [
    (r"input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight", ("input_layernorm.weight",), COPY),
    (r"pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight", ("post_attention_layernorm.weight",), COPY),
]
_GQA_ATTENTION: list[Rule] = [
    (
        r"self_attention\.linear_qkv\.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV,
    ),
    (
        r"self_attention\.linear_qkv\.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        QKV,
    ),
    (r"self_attention\.linear_proj\.weight", ("self_attn.o_proj.weight",), COPY),
]
_QK_NORM: list[Rule] = [
    (r"self_attention\.q_layernorm\.weight", ("self_attn.q_norm.weight",), COPY),
    (r"self_attention\.k_layernorm\.weight", ("self_attn.k_norm.weight",), COPY),
]
_MLA_ATTENTION: list[Rule] = [
    (r"self_attention\.linear_q_proj\.weight", ("self_attn.q_proj.weight",), COPY),
    (r"self_attention\.linear_q_down_proj\.weight", ("self_attn.q_a_proj.weight",), COPY),
    (
        r"self_attention\.linear_q_up_proj\.layer_norm_weight|self_attention\.q_layernorm\.weight",
        ("self_attn.q_a_layernorm.weight",),
        COPY,
    ),
    (r"self_attention\.linear_q_up_proj\.weight", ("self_attn.q_b_proj.weight",), COPY),
    (r"self_attention\.linear_kv_down_proj\.weight", ("self_attn.kv_a_proj_with_mqa.weight",), COPY),
    (
        r"self_attention\.linear_kv_up_proj\.layer_norm_weight|self_attention\.kv_layernorm\.weight",
        ("self_attn.kv_a_layernorm.weight",),
        COPY,
    ),
    (r"self_attention\.linear_kv_up_proj\.weight", ("self_attn.kv_b_proj.weight",), COPY),
    (r"self_attention\.linear_proj\.weight", ("self_attn.o_proj.weight",), COPY),
]
_DENSE_MLP: list[Rule] = [
    (r"mlp\.linear_fc1\.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP),
    (r"mlp\.linear_fc2\.weight", ("mlp.down_proj.weight",), COPY),
]
# SequentialMLP names experts `local_experts.{E}.linear_fc1.weight`; TE's grouped GEMM `linear_fc1.weight{E}`.
_ROUTED_EXPERTS: list[Rule] = [
    (r"mlp\.router\.weight", ("mlp.gate.weight",), COPY),
    (
        r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc1\.weight|linear_fc1\.weight(\d+))",
        ("mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"),
        GATE_UP,
    ),
    (
        r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc2\.weight|linear_fc2\.weight(\d+))",
        ("mlp.experts.{E}.down_proj.weight",),
        COPY,
    ),
]
_SHARED_EXPERTS: list[Rule] = [
    (r"mlp\.router\.expert_bias", ("mlp.gate.e_score_correction_bias",), COPY),
    (
        r"mlp\.shared_experts\.linear_fc1\.weight",
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        GATE_UP,
    ),
    (r"mlp\.shared_experts\.linear_fc2\.weight", ("mlp.shared_experts.down_proj.weight",), COPY),
]
_GLM4_EXTRA: list[Rule] = [
    (r"post_self_attn_layernorm\.weight", ("post_self_attn_layernorm.weight",), COPY),
    (r"post_mlp_layernorm\.weight", ("post_mlp_layernorm.weight",), COPY),
    (r"mlp\.linear_fc1\.weight", ("mlp.gate_up_proj.weight",), COPY),
]

_LAYER_RULES: dict[str, list[Rule]] = {
    "llama": _NORMS + _GQA_ATTENTION + _DENSE_MLP,
    "qwen2": _NORMS + _GQA_ATTENTION + _DENSE_MLP,
    "mimo": _NORMS + _GQA_ATTENTION + _DENSE_MLP,
    "qwen3": _NORMS + _GQA_ATTENTION + _QK_NORM + _DENSE_MLP,
    "qwen3_moe": _NORMS + _GQA_ATTENTION + _QK_NORM + _ROUTED_EXPERTS + _DENSE_MLP,
    "glm4": _NORMS + _GQA_ATTENTION + _GLM4_EXTRA + _DENSE_MLP,
    "glm4_moe": _NORMS + _GQA_ATTENTION + _QK_NORM + _ROUTED_EXPERTS + _SHARED_EXPERTS + _DENSE_MLP,
    "deepseek_v3": _NORMS + _MLA_ATTENTION + _ROUTED_EXPERTS + _SHARED_EXPERTS + _DENSE_MLP,
}

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.+)")


def strip_wrapper_prefix(name: str) -> str:
    """Drop the `module.` prefixes that DDP / Float16Module wrappers add."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _match_layer_rules(rest: str, family: str, hf_prefix: str) -> tuple[list[str], str] | None:
    for pattern, hf_names, kind in _LAYER_RULES[family]:
        match = re.fullmatch(pattern, rest)
        if match:
            expert = next((g for g in match.groups() if g is not None), None)
            return [hf_prefix + n.format(E=expert) for n in hf_names], kind
    return None


def _mtp_names(index: int, rest: str, dims: ModelDims) -> tuple[list[str], str] | None:
    """MTP layers: MiMo keeps them in `model.mtp_layers.{i}`; DeepSeek-V3 and GLM-4.5 append them as extra decoder
    layers."""
    if dims.family == "mimo":
        prefix = f"model.mtp_layers.{index}."
        own = {
            "enorm.weight": ("token_layernorm.weight", COPY),
            "hnorm.weight": ("hidden_layernorm.weight", COPY),
            "eh_proj.weight": ("input_proj.weight", SWAP_HALVES),
            "final_layernorm.weight": ("final_layernorm.weight", COPY),
        }
    elif dims.family in ("deepseek_v3", "glm4_moe"):
        prefix = f"model.layers.{dims.num_layers + index}."
        own = {
            "enorm.weight": ("enorm.weight", COPY),
            "hnorm.weight": ("hnorm.weight", COPY),
            "eh_proj.weight": ("eh_proj.weight", COPY),
            "final_layernorm.weight": ("shared_head.norm.weight", COPY),
        }
    else:
        return None
    if rest in own:
        hf_name, kind = own[rest]
        return [prefix + hf_name], kind
    if rest.startswith("transformer_layer."):
        return _match_layer_rules(rest[len("transformer_layer.") :], dims.family, prefix)
    return None


def hf_names_for(name: str, dims: ModelDims) -> tuple[list[str], str]:
    """The HF names a Megatron parameter becomes, and how its layout changes.

    Args:
        name: a global, full Megatron name (wrapper prefixes are dropped here).
        dims: the model's `ModelDims`.

    Returns:
        (HF names, kind) where kind is one of "copy", "qkv", "gate_up", "vocab", "swap_halves".

    Raises:
        ValueError: when the family has no mapping for the name.
    """
    name = strip_wrapper_prefix(name)
    found = None
    if name == "embedding.word_embeddings.weight":
        found = ["model.embed_tokens.weight"], VOCAB
    elif name == "output_layer.weight":
        # With tied embeddings the last pipeline stage keeps a copy of the embedding as its output layer.
        found = ["model.embed_tokens.weight" if dims.tied_embeddings else "lm_head.weight"], VOCAB
    elif name == "decoder.final_layernorm.weight":
        found = ["model.norm.weight"], COPY
    elif match := _LAYER.fullmatch(name):
        found = _match_layer_rules(match.group(2), dims.family, f"model.layers.{match.group(1)}.")
    elif match := _MTP_LAYER.fullmatch(name):
        found = _mtp_names(int(match.group(1)), match.group(2), dims)
    if found is None:
        raise ValueError(f"no {dims.family} mapping for the Megatron parameter {name!r}")
    return found


def _qkv_shape(dims: ModelDims) -> tuple[int, int]:
    if dims.num_attention_heads % dims.num_query_groups:
        raise ValueError(
            f"num_attention_heads ({dims.num_attention_heads}) is not a multiple of num_query_groups "
            f"({dims.num_query_groups})"
        )
    return dims.num_query_groups, dims.num_attention_heads // dims.num_query_groups


def split_to_hf(tensor: torch.Tensor, kind: str, dims: ModelDims) -> list[torch.Tensor]:
    """Split one full Megatron tensor into the HF tensors of `hf_names_for` (same order)."""
    if kind == COPY:
        return [tensor]
    if kind == VOCAB:
        return [tensor[: dims.vocab_size]]
    if kind == GATE_UP:
        return list(tensor.chunk(2, dim=0))
    if kind == SWAP_HALVES:
        first, second = tensor.chunk(2, dim=1)
        return [torch.cat([second, first], dim=1)]
    if kind == QKV:
        groups, q_per_group = _qkv_shape(dims)
        grouped = tensor.reshape(groups, q_per_group + 2, dims.head_dim, *tensor.shape[1:])
        q, k, v = grouped.split([q_per_group, 1, 1], dim=1)
        return [part.reshape(-1, *tensor.shape[1:]) for part in (q, k, v)]
    raise ValueError(f"unknown layout kind {kind!r}")


def merge_from_hf(tensors: list[torch.Tensor], kind: str, dims: ModelDims, rows: int | None = None) -> torch.Tensor:
    """Inverse of `split_to_hf`: the full Megatron tensor from its HF tensors.

    Args:
        tensors: in the order of `hf_names_for`.
        kind: the layout kind.
        dims: the model's `ModelDims`.
        rows: for "vocab", the padded vocabulary; extra rows are zeros.
    """
    if kind == COPY:
        return tensors[0]
    if kind == VOCAB:
        (table,) = tensors
        if rows is None or rows == table.shape[0]:
            return table
        padding = table.new_zeros(rows - table.shape[0], *table.shape[1:])
        return torch.cat([table, padding], dim=0)
    if kind == GATE_UP:
        return torch.cat(tensors, dim=0)
    if kind == SWAP_HALVES:
        first, second = tensors[0].chunk(2, dim=1)
        return torch.cat([second, first], dim=1)
    if kind == QKV:
        groups, q_per_group = _qkv_shape(dims)
        q, k, v = tensors
        trailing = q.shape[1:]
        q = q.reshape(groups, q_per_group * dims.head_dim, *trailing)
        k = k.reshape(groups, dims.head_dim, *trailing)
        v = v.reshape(groups, dims.head_dim, *trailing)
        return torch.cat([q, k, v], dim=1).reshape(-1, *trailing)
    raise ValueError(f"unknown layout kind {kind!r}")


def convert_megatron_tensor_to_hf(name: str, tensor: torch.Tensor, dims: ModelDims) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs for one global, full Megatron tensor."""
    hf_names, kind = hf_names_for(name, dims)
    return list(zip(hf_names, split_to_hf(tensor, kind, dims)))


def convert_hf_tensors_to_megatron(
    name: str, fetch: Callable[[str], torch.Tensor], dims: ModelDims, rows: int | None = None
) -> torch.Tensor:
    """The full Megatron tensor `name`, built from HF tensors read through `fetch(hf_name)`."""
    hf_names, kind = hf_names_for(name, dims)
    return merge_from_hf([fetch(n) for n in hf_names], kind, dims, rows=rows)
