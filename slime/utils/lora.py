"""What trainers, engines and rollouts agree on about the LoRA adapter being trained (`--lora-rank`).

The engines serve the adapter under one name, `POLICY_ADAPTER`, which every rollout request names in `lora_path`
(SGLang's field); each weight update replaces it. Tensors travel under PEFT's saved names
(`base_model.model.<HF module>.lora_A.weight`), so an adapter folder saved by peft and one pushed by a trainer read
the same way.

With `--multi-lora-n-adapters K` (K >= 2) the run trains K adapters on one base, named `slime-policy-0` ..
`slime-policy-{K-1}` (`policy_adapters`) both on the engines and in the trainer's peft model; a sample's
`lora_adapter` (its index) picks the one its requests name, and pushed tensors carry their adapter's name as a
prefix (`qualified_name`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slime.utils.types import Sample

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
    return args.lora_rank > 0


def engines_keep_base(args: argparse.Namespace) -> bool:
    """`--lora-train-only`: the adapter trains while the engines keep generating with the base model they loaded, so
    no weight update is ever pushed and the engines serve no adapter."""
    return lora_enabled(args) and args.lora_train_only


def engines_serve_adapter(args: argparse.Namespace) -> bool:
    """Whether the engines serve the trained adapter beside the base (`--lora-rank` without `--lora-train-only`)."""
    return lora_enabled(args) and not engines_keep_base(args)


def lora_adapter_count(args: argparse.Namespace) -> int:
    """How many adapters the run trains (`--multi-lora-n-adapters`; 1 unless it is given)."""
    return args.multi_lora_n_adapters if lora_enabled(args) else 1


def policy_adapters(args: argparse.Namespace) -> list[str]:
    """The engines' names of the trained adapters, in index order: `[POLICY_ADAPTER]` for one adapter, else
    `slime-policy-0` .. `slime-policy-{K-1}`."""
    count = lora_adapter_count(args)
    return [POLICY_ADAPTER] if count == 1 else [f"{POLICY_ADAPTER}-{k}" for k in range(count)]


def rollout_adapter(args: argparse.Namespace, sample: Sample | None = None) -> str | None:
    """The adapter a rollout request generates with (`lora_path`), None for the base model (no LoRA, or
    `--lora-train-only`). With several adapters it is the sample's (`sample.lora_adapter`).

    Raises:
        ValueError: several adapters train and the sample names none (or one out of range).
    """
    if not engines_serve_adapter(args):
        return None
    adapters = policy_adapters(args)
    if len(adapters) == 1:
        return adapters[0]
    index = getattr(sample, "lora_adapter", None)
    if not isinstance(index, int) or not 0 <= index < len(adapters):
        raise ValueError(
            f"--multi-lora-n-adapters {len(adapters)}: sample {getattr(sample, 'index', None)} has lora_adapter "
            f"{index!r}, not an adapter index in 0..{len(adapters) - 1}; samples come tagged from the data source, "
            "so a generate function that makes new samples must copy the tag (sample.lora_adapter)"
        )
    return adapters[index]


def adapter_metric_name(name: str, adapter: int) -> str:
    """A metric's name for one adapter: `adapter_<k>/` after its first segment (`rollout/reward` ->
    `rollout/adapter_0/reward`, `train/loss` -> `train/adapter_0/loss`)."""
    head, slash, rest = name.partition("/")
    return f"{head}/adapter_{adapter}/{rest}" if slash else f"adapter_{adapter}/{name}"


def qualified_name(adapter: str, tensor_name: str) -> str:
    """A pushed tensor's name with its adapter's in front, when several adapters travel together."""
    return f"{adapter}/{tensor_name}"


def split_by_adapter(tensors: list[tuple[str, Any]]) -> dict[str, list[tuple[str, Any]]]:
    """Group (name, tensor) pairs by the adapter `qualified_name` put in front; unqualified names are
    `POLICY_ADAPTER`'s. The names come back as PEFT saved names."""
    groups: dict[str, list[tuple[str, Any]]] = {}
    for name, tensor in tensors:
        adapter, _, plain = name.rpartition("/")
        groups.setdefault(adapter or POLICY_ADAPTER, []).append((plain, tensor))
    return groups


def saved_adapter_name(parameter_name: str, adapter: str = "default") -> str:
    """PEFT's name for a LoRA parameter in a saved adapter: the live name without the adapter's own segment.

    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
    """
    return parameter_name.replace(f".{adapter}.", ".")
