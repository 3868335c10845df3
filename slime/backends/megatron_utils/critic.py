"""The Megatron critic's value head: one value per position in place of the GPT model's LM head.

A PPO critic is the actor's GPT backbone with its vocabulary-parallel output layer replaced by a
`[hidden] -> 1` linear head (`attach_value_head`). The head is replicated on every tensor-parallel
rank, not split: each rank holds the full hidden states (or, with sequence parallelism, its slice of
the sequence, gathered after the head), so every rank computes the same values and the same loss.
Its weights start at exactly zero, like the FSDP critic's, so both backends start from equal values.

The head keeps the output layer's name (`output_layer.weight` `[1, hidden]`, `output_layer.bias`
`[1]`), so GPTModel's forward and its sharded state dict need no change; the critic is built with
untied embeddings and without MTP layers, which both use the LM head. The backbone comes from the
same HF weights as the actor (`load_backbone_from_hf`), all but `lm_head`.

    model = build_model(args, role="critic")   # model.py: calls attach_value_head on the last stage
    load_backbone_from_hf(model, hf_dir)
    output = model(input_ids, position_ids, attention_mask)   # last stage: [1, N, 1] values
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch
from torch import nn

from slime.backends.megatron_utils.checkpoint import is_hf_checkpoint
from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights

# Parameter names of the value head inside the GPTModel (it replaces `output_layer`).
VALUE_HEAD_NAMES = ("output_layer.weight", "output_layer.bias")


class ValueHead(nn.Module):
    """`hidden -> 1` linear head, replicated over tensor-parallel ranks, called like GPTModel's output layer.

    Args:
        hidden_size: The model's hidden size.
        sequence_parallel: Hidden states arrive split along the sequence over the TP group
            (`--sequence-parallel`); the values are gathered back to the full sequence.
        dtype: Parameter dtype (`config.params_dtype`; `Float16Module` casts later under --bf16/--fp16).
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        for param in (self.weight, self.bias):
            # Megatron's optimizer groups output-layer parameters by this tag (e.g. --decoupled-lr).
            param.is_embedding_or_output_parameter = True
            # With sequence parallelism each TP rank sees part of the sequence, so the head's gradient
            # is a partial sum; `finalize_model_grads` all-reduces parameters tagged like this over TP.
            param.sequence_parallel = sequence_parallel

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        """`[s, b, hidden]` hidden states -> (`[s, b, 1]` values, no bias); `weight` and
        `runtime_gather_output` (an LM head's arguments) are ignored."""
        values = nn.functional.linear(hidden_states, self.weight, self.bias)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # Every TP rank computes the loss from the full row, so the backward keeps only the
            # local slice of the gradient (a split, not a reduce-scatter).
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def critic_model_args(args: Namespace) -> Namespace:
    """A copy of the Megatron flags for building a critic: untied embeddings and no MTP layers.

    Both would tie the value head to the vocabulary (shared LM head / MTP losses through it).
    """
    critic_args = Namespace(**vars(args))
    critic_args.untie_embeddings_and_output_weights = True
    critic_args.mtp_num_layers = None
    return critic_args


def attach_value_head(model: nn.Module) -> nn.Module:
    """Replace a last-stage GPTModel's `output_layer` with a zero-initialized `ValueHead` (in place).

    Args:
        model: An unwrapped megatron-core GPTModel with `post_process=True`, built from `critic_model_args`.

    Returns:
        The same model; its forward now returns `[b, s, 1]` values instead of logits.
    """
    if getattr(model, "share_embeddings_and_output_weights", False) or getattr(model, "mtp_process", False):
        raise ValueError(
            "the critic's GPTModel must have untied embeddings and no MTP layers (build it from critic_model_args; "
            "a --custom-model-provider-path model must do the same)"
        )
    config = model.config
    head = ValueHead(config.hidden_size, bool(config.sequence_parallel), config.params_dtype)
    model.output_layer = head.to(model.output_layer.weight.device)
    return model


def load_backbone_from_hf(model: nn.Module | list[nn.Module], hf_dir: str | Path | None) -> set[str]:
    """Load the HF weights into a critic's backbone (everything but the value head, which keeps its zeros).

    Args:
        model: The critic's chunks (or one chunk), wrapped or not.
        hf_dir: The HF model folder the actor starts from (`--hf-checkpoint`, or `--load` when it is one).

    Returns:
        The HF tensor names read (`lm_head.weight` is not among them).

    Raises:
        ValueError: `hf_dir` is not an HF model folder.
    """
    if not hf_dir or not is_hf_checkpoint(hf_dir):
        raise ValueError(
            f"the Megatron critic starts from HF weights, but {hf_dir!r} is not an HF model folder (config.json and "
            "safetensors); pass --hf-checkpoint with the actor's HF model"
        )
    return load_hf_weights(model, hf_dir, exclude=VALUE_HEAD_NAMES)
