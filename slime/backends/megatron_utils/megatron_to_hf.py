"""Megatron -> HF weights: names and layouts for weight sync to the engines and for HF exports.

`convert_to_hf` maps one full, global Megatron tensor; `megatron_state_to_hf` walks a model, gathers
tensor-parallel shards and the experts of every expert-parallel rank, and yields HF tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from slime.backends.megatron_utils.parallel import (
    gather_tensor_parallel,
    global_param_name,
    is_adapter_weight,
    is_expert_weight,
    named_weights,
)
from slime.backends.megatron_utils.unwrap import unwrap_model
from slime.backends.megatron_utils.weight_mapping import ModelDims, convert_megatron_tensor_to_hf, strip_wrapper_prefix


def convert_to_hf(
    name: str, param: torch.Tensor, family: str, config, vocab_size: int, tied_embeddings: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one Megatron parameter.

    Args:
        name: the global name (global layer and expert numbers; `module.` prefixes are ignored),
            e.g. "module.module.decoder.layers.3.self_attention.linear_qkv.weight".
        param: the full tensor (tensor-parallel shards already gathered).
        family: model family, e.g. "qwen3" (see `config.SUPPORTED_FAMILIES`).
        config: the model's megatron-core `TransformerConfig` (heads, query groups, head dim).
        vocab_size: the true vocabulary; padded rows are dropped.
        tied_embeddings: the output layer shares the embedding (then it maps to embed_tokens).

    Returns:
        e.g. [("model.layers.3.self_attn.q_proj.weight", q), (... k_proj ...), (... v_proj ...)].

    Raises:
        ValueError: unknown family (naming the supported ones) or a name the family does not map.
    """
    dims = ModelDims.from_config(config, family, vocab_size, tied_embeddings)
    return convert_megatron_tensor_to_hf(name, param, dims)


def model_dims(model: nn.Module | list[nn.Module], family: str, vocab_size: int) -> ModelDims:
    """`ModelDims` of a (possibly wrapped, possibly chunked) megatron-core GPT model."""
    gpt = unwrap_model(model[0] if isinstance(model, list) else model)
    return ModelDims.from_config(gpt.config, family, vocab_size, gpt.share_embeddings_and_output_weights)


def megatron_state_to_hf(
    model: nn.Module | list[nn.Module], family: str, vocab_size: int, include_mtp: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the HF tensors of this rank's pipeline stage, gathered over TP and expert parallelism.

    A collective: every rank of the stage must iterate it to the end, in the same order. Every rank
    of a stage gets the same full tensors; with pipeline parallelism each stage yields only its own
    layers (and the first stage the embedding), so collecting a whole model is the caller's job. LoRA adapters
    are left out: the HF model's weights are the base's.
    Tensors of unsplit parameters may be views of the live parameters: clone them to keep a snapshot.

    Args:
        model: the model chunks (or one chunk), wrapped or not.
        family: model family, e.g. "llama".
        vocab_size: the true vocabulary (the HF config's `vocab_size`).
        include_mtp: also yield the multi-token-prediction layers (an engine without a draft model takes none).
    """
    from megatron.core import parallel_state

    chunks = model if isinstance(model, list) else [model]
    dims = model_dims(chunks, family, vocab_size)
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    for chunk in chunks:
        for name, tensor in named_weights(chunk):
            if name == "output_layer.weight" and dims.tied_embeddings:
                continue  # the embedding, already yielded by the first stage
            if is_adapter_weight(name):
                continue  # a LoRA adapter: not a weight of the HF model (lora.adapter_state_to_hf exports it)
            if not include_mtp and strip_wrapper_prefix(name).startswith("mtp."):
                continue
            full = gather_tensor_parallel(name, tensor, chunk)
            if is_expert_weight(name) and ep_size > 1:
                per_rank = [torch.empty_like(full) for _ in range(ep_size)]
                dist.all_gather(per_rank, full.contiguous(), group=parallel_state.get_expert_model_parallel_group())
                for ep_rank, expert_tensor in enumerate(per_rank):
                    global_name = global_param_name(name, chunk, expert_parallel_rank=ep_rank)
                    yield from convert_megatron_tensor_to_hf(global_name, expert_tensor, dims)
            else:
                yield from convert_megatron_tensor_to_hf(global_param_name(name, chunk), full, dims)
