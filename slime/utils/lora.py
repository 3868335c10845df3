"""What trainers, engines and rollouts agree on about the LoRA adapter being trained (`--lora-rank`).

The engines serve the adapter under one name, `POLICY_ADAPTER`, which every rollout request names in `lora_path`
(SGLang's field); each weight update replaces it. Tensors travel under PEFT's saved names
(`base_model.model.<HF module>.lora_A.weight`), so an adapter folder saved by peft and one pushed by a trainer read
the same way.
"""

from __future__ import annotations

import argparse

POLICY_ADAPTER = "slime-policy"
# A PEFT adapter folder: its config and its weights (safetensors only; slime never reads adapter_model.bin).
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# The adapter's PEFT folder inside each checkpoint iteration of a LoRA run.
CHECKPOINT_ADAPTER_DIR = "adapter"
# The HF projections the Megatron backend can adapt (`--target-modules` leaf names; all-linear means all of them).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def lora_enabled(args: argparse.Namespace) -> bool:
    """Whether the actor trains a LoRA adapter (`--lora-rank` > 0)."""
    return getattr(args, "lora_rank", 0) > 0


def engines_keep_base(args: argparse.Namespace) -> bool:
    """`--lora-train-only`: the adapter trains while the engines keep generating with the base model they loaded, so
    no weight update is ever pushed and the engines serve no adapter."""
    return lora_enabled(args) and getattr(args, "lora_train_only", False)


def engines_serve_adapter(args: argparse.Namespace) -> bool:
    """Whether the engines serve the trained adapter beside the base (`--lora-rank` without `--lora-train-only`)."""
    return lora_enabled(args) and not engines_keep_base(args)


def rollout_adapter(args: argparse.Namespace) -> str | None:
    """The adapter rollout requests generate with (`lora_path`), None for the base model (no LoRA, or
    `--lora-train-only`)."""
    return POLICY_ADAPTER if engines_serve_adapter(args) else None


def saved_adapter_name(parameter_name: str, adapter: str = "default") -> str:
    """PEFT's name for a LoRA parameter in a saved adapter: the live name without the adapter's own segment.

    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
    """
    return parameter_name.replace(f".{adapter}.", ".")
