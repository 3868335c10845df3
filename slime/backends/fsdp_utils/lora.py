"""LoRA on the FSDP trainer (`--lora-rank`): the actor becomes a peft model whose base is frozen.

Only the adapter is trained, so the optimizer holds only its state; the reference model is the base itself (the
adapter switched off, `adapters_disabled`), never a second copy; checkpoints keep the adapter (and its
optimizer state) only, plus a PEFT folder of it; a weight update sends only the adapter (`adapter_tensors`).
"""

from __future__ import annotations

import contextlib
import json
from argparse import Namespace
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils.model import reshard
from slime.utils.lora import saved_adapter_name

if TYPE_CHECKING:
    from peft import PeftModel


def apply_lora(model: nn.Module, args: Namespace) -> PeftModel:
    """Wrap an unsharded HF causal LM with a trainable LoRA adapter: a new one from the flags, or
    `--lora-adapter-path`'s.

    The adapter folder's rank, alpha and targets were checked against the flags at parse time.

    Raises:
        ValueError: a target matches no module.
    """
    # peft costs ~2 s of imports: only trainers with an adapter pay them.
    from peft import LoraConfig, PeftModel, get_peft_model

    path = args.lora_adapter_path
    if path is not None:
        return PeftModel.from_pretrained(model, path, is_trainable=True)
    targets = args.target_modules
    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        exclude_modules=args.exclude_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"--target-modules {' '.join(targets)}: {error}") from None


def adapter_config(model: PeftModel) -> dict:
    """The adapter's `adapter_config.json` contents (targets resolved to leaf names), as peft saves them."""
    config = model.peft_config["default"].to_dict()
    targets = config["target_modules"]
    if isinstance(targets, set | list | tuple):
        # Leaf names (q_proj, ...) as SGLang's --lora-target-modules takes them, unless some modules of a leaf name
        # were excluded and only full paths say which.
        targets = sorted(targets) if config.get("exclude_modules") else sorted({t.rsplit(".", 1)[-1] for t in targets})
        config["target_modules"] = targets
    if isinstance(config.get("exclude_modules"), set):
        config["exclude_modules"] = sorted(config["exclude_modules"])
    return json.loads(json.dumps(config, default=str))


def adapter_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT saved name, full adapter tensor), a collective over the FSDP group: every rank iterates to the end."""
    reshard(model)
    for name, param in model.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            yield saved_adapter_name(name), full.detach().to(dtype or full.dtype).contiguous()


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block the model computes the base model's outputs (the reference under LoRA).

    Each LoRA layer's own switch is flipped and restored; peft's `disable_adapter()` also turns `requires_grad` off,
    and an FSDP2 unit whose first forward sees no trainable parameter never sets up its gradient dtypes (with
    --bf16 the first backward then fails).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    states = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, state in zip(layers, states):
            layer._disable_adapters = state
