"""Where a local Megatron parameter sits in the full model: global names, TP gather and TP shard.

A rank holds one pipeline stage (layers numbered from 0 again), its experts (numbered from 0 on each
expert-parallel rank) and one tensor-parallel shard of each split weight. Megatron tags split weights
with `tensor_model_parallel=True` and `partition_dim` (0 for column-parallel and vocab-parallel, 1 for
row-parallel). Expert weights are split over the expert-tensor-parallel group instead.

SwiGLU's `linear_fc1` is split per half: rank r holds `[gate_r; up_r]`, so the full `[gate; up]` is
not the plain concatenation of the shards.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from slime.backends.megatron_utils.unwrap import unwrap_model
from slime.backends.megatron_utils.weight_mapping import strip_wrapper_prefix

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_SEQUENTIAL_EXPERT = re.compile(r"(mlp\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_GATED_FC1 = re.compile(r"linear_fc1\.(?:weight|bias)\d*$")


def named_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters plus the MoE router's `expert_bias` buffers, named without wrapper prefixes."""
    for name, param in model.named_parameters():
        yield strip_wrapper_prefix(name), param
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            yield strip_wrapper_prefix(name), buffer


def is_adapter_weight(name: str) -> bool:
    """A LoRA adapter's factor (lora.py attaches them to a linear as `.lora`): not a weight of the HF model."""
    return ".lora." in name


def is_expert_weight(name: str) -> bool:
    """Routed-expert weights (split over expert parallel ranks); shared experts are dense weights."""
    return ".mlp.experts." in name


def global_param_name(name: str, model: nn.Module, expert_parallel_rank: int | None = None) -> str:
    """The name of a local parameter in the full model: global layer number and global expert number.

    Args:
        name: the local name (wrapper prefixes allowed).
        model: the model chunk holding it.
        expert_parallel_rank: whose experts these are (default: this rank's).
    """
    from megatron.core import parallel_state

    name = strip_wrapper_prefix(name)
    gpt = unwrap_model(model)
    match = _LOCAL_LAYER.match(name)
    if match:
        # TransformerLayer.layer_number is global and 1-based.
        layer_number = gpt.decoder.layers[int(match.group(1))].layer_number - 1
        name = f"decoder.layers.{layer_number}." + name[match.end() :]
    if is_expert_weight(name):
        if expert_parallel_rank is None:
            expert_parallel_rank = parallel_state.get_expert_model_parallel_rank()
        num_local = gpt.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        offset = expert_parallel_rank * num_local
        name = _SEQUENTIAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name)
        name = _GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}", name)
    return name


def _split_group(name: str) -> dist.ProcessGroup:
    from megatron.core import parallel_state

    if is_expert_weight(name):
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def _is_gated_fc1(name: str, model: nn.Module) -> bool:
    return bool(_GATED_FC1.search(name)) and unwrap_model(model).config.gated_linear_unit


def gather_tensor_parallel(name: str, tensor: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """The full tensor of a local shard (a collective over its TP group; unsplit tensors come back as is).

    Args:
        name: the local parameter name (picks the group: expert weights use expert-TP).
        tensor: the local parameter.
        model: the model chunk holding it (for the SwiGLU layout).
    """
    if not getattr(tensor, "tensor_model_parallel", False):
        return tensor.detach()
    group = _split_group(name)
    size = dist.get_world_size(group)
    if size == 1:
        return tensor.detach()
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    if _is_gated_fc1(name, model):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim=0)
    return torch.cat(shards, dim=tensor.partition_dim)


def full_shape(name: str, tensor: torch.Tensor) -> tuple[int, ...]:
    """The global shape of a local shard (before SwiGLU or vocabulary details, which keep the size)."""
    if not getattr(tensor, "tensor_model_parallel", False):
        return tuple(tensor.shape)
    shape = list(tensor.shape)
    shape[tensor.partition_dim] *= dist.get_world_size(_split_group(name))
    return tuple(shape)


def shard_tensor_parallel(name: str, full: torch.Tensor, tensor: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """This rank's shard of a full tensor, laid out like the local parameter `tensor`.

    Raises:
        ValueError: when the shard's shape differs from the local parameter's, naming both.
    """
    shard = full
    if getattr(tensor, "tensor_model_parallel", False):
        group = _split_group(name)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if _is_gated_fc1(name, model):
            gate, up = full.chunk(2, dim=0)
            shard = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
        else:
            shard = full.chunk(size, dim=tensor.partition_dim)[rank]
    if shard.shape != tensor.shape:
        raise ValueError(
            f"{name}: the converted weight has shape {tuple(full.shape)} (shard {tuple(shard.shape)}) but the "
            f"model's parameter is {tuple(tensor.shape)}; the model flags do not match the checkpoint."
        )
    return shard
