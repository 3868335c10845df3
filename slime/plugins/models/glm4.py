"""GLM-4 (HF `Glm4ForCausalLM`, model_type glm4) decoder layers for megatron-core.

A GLM-4 layer is a Llama layer plus two RMSNorms on the branch outputs, before each residual add:

    h = x + post_self_attn_layernorm(attention(input_layernorm(x)))
    y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))

megatron-core's TransformerLayer has no such norms, so `Glm4TransformerLayer` adds them and applies
each inside the layer's bias-dropout-add step: every code path of TransformerLayer that adds a branch
to the residual goes through that step, so the rest of the layer (recompute, offloading, TE fusions)
stays megatron-core's own. The norms are named as in HF (`decoder.layers.N.post_self_attn_layernorm.weight`),
which is what the glm4 weight mapping expects. Partial interleaved rotary, QKV bias and SwiGLU are
plain TransformerConfig settings (--rotary-percent 0.5 --rotary-interleaved --add-qkv-bias --swiglu).

Use with Megatron flags: `--spec slime.plugins.models.glm4 get_glm_spec` (upstream's `--spec
slime_plugins.models.glm4 get_glm_spec` loads it too).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import Tensor

# (output, bias or None), residual, dropout probability -> new hidden states
ResidualAdd = Callable[[tuple[Tensor, Tensor | None], Tensor, float], Tensor]


@dataclass
class Glm4LayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayerSubmodules plus GLM-4's norms on the attention and MLP outputs."""

    post_self_attn_layernorm: ModuleSpec | type = IdentityOp
    post_mlp_layernorm: ModuleSpec | type = IdentityOp


class Glm4TransformerLayer(TransformerLayer):
    """megatron-core TransformerLayer that normalizes the attention and MLP outputs before the residual adds."""

    def __init__(self, config, submodules: Glm4LayerSubmodules, *args, **kwargs):
        if getattr(config, "inference_fuse_tp_communication", False):
            # That path fuses the residual add into the output projection, skipping the post norms.
            raise ValueError("GLM-4 layers do not support inference_fuse_tp_communication; turn it off.")
        super().__init__(config, submodules, *args, **kwargs)
        norm_kwargs = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, **norm_kwargs)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm_kwargs)
        # TransformerLayer calls `self.<x>_bda(training, fused)(output_with_bias, residual, p)` to add each
        # branch to the residual; wrapping that step puts each norm between the branch and the add.
        self._attn_residual_add = self.self_attn_bda
        self._mlp_residual_add = self.mlp_bda
        self.self_attn_bda = self._normed_attn_residual_add
        self.mlp_bda = self._normed_mlp_residual_add

    def _normed_attn_residual_add(self, training: bool, fused: bool) -> ResidualAdd:
        return _norm_before(self.post_self_attn_layernorm, self._attn_residual_add(training, fused))

    def _normed_mlp_residual_add(self, training: bool, fused: bool) -> ResidualAdd:
        return _norm_before(self.post_mlp_layernorm, self._mlp_residual_add(training, fused))


def _norm_before(norm: Callable[[Tensor], Tensor], residual_add: ResidualAdd) -> ResidualAdd:
    def add(output_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float) -> Tensor:
        output, bias = output_with_bias
        if bias is not None:  # the norm sees the full branch output (GLM-4 itself has no output biases)
            output = output + bias
        return residual_add((norm(output), None), residual, prob)

    return add


def glm4_layer_spec(layer_spec: ModuleSpec, norm: ModuleSpec | type) -> ModuleSpec:
    """A megatron-core GPT layer spec turned into a GLM-4 one (same submodules, plus the two post norms).

    Args:
        layer_spec: a dense `TransformerLayer` spec, e.g. from `get_gpt_layer_local_spec`.
        norm: the norm module for the post norms (TENorm with TransformerEngine, else the local norm).

    Returns:
        the `Glm4TransformerLayer` spec.
    """
    if layer_spec.module is not TransformerLayer:
        raise ValueError(f"GLM-4 layers extend megatron-core's TransformerLayer, got {layer_spec.module.__name__}")
    base = {f.name: getattr(layer_spec.submodules, f.name) for f in fields(TransformerLayerSubmodules)}
    submodules = Glm4LayerSubmodules(**base, post_self_attn_layernorm=norm, post_mlp_layernorm=norm)
    return replace(layer_spec, module=Glm4TransformerLayer, submodules=submodules)


def get_glm_spec(args: argparse.Namespace, config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The decoder block spec of GLM-4 for this pipeline stage: megatron-core's GPT block with GLM-4 layers.

    Called by slime's model builder for `--spec slime.plugins.models.glm4 get_glm_spec` (upstream's name).

    Args:
        args: Megatron flags (`--transformer-impl local` forces the local, non-TE modules).
        config: the model's megatron-core `TransformerConfig`.
        vp_stage: virtual pipeline stage index, or None without virtual pipelining.

    Returns:
        a `TransformerBlockSubmodules` with one `Glm4TransformerLayer` spec per layer of the stage and
        the final norm.

    Raises:
        ValueError: for an MoE config (GLM-4 is dense; GLM-4.5 MoE has no post norms).
    """
    from slime.backends.megatron_utils.config import use_transformer_engine

    if config.num_moe_experts:
        raise ValueError(
            "get_glm_spec builds dense GLM-4 layers, but --num-experts is set; GLM-4 MoE models (GLM-4.5) "
            "have no post-attention/post-MLP norms: drop --spec for them."
        )
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_transformer_engine(args),
        normalization=config.normalization,
        vp_stage=vp_stage,
    )
    layers = [glm4_layer_spec(spec, norm=block.layer_norm) for spec in block.layer_specs]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=block.layer_norm)
