"""LoRA on the FSDP trainer (`--lora-rank`): the actor becomes a peft model whose base is frozen.

Only the adapter is trained, so the optimizer holds only its state; the reference model is the base itself (the
adapter switched off, `adapters_disabled`), never a second copy; checkpoints keep the adapter (and its
optimizer state) only, plus a PEFT folder of it; a weight update sends only the adapter (`adapter_tensors`).

`--multi-lora-n-adapters K`: K named peft adapters on the one base (`slime-policy-0` ..), each with its own optimizer
and LR scheduler (`adapter_optimizers`). Every adapter's parameters stay trainable; which one computes is switched
(`activate_adapter`), and each trains on its own samples in turn (`train_each_adapter`), so an adapter gets no
gradient, and its optimizer no step, from another's samples.
"""

from __future__ import annotations

import contextlib
import json
from argparse import Namespace
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from slime.backends.fsdp_utils.model import build_lr_scheduler, build_optimizer, reshard
from slime.utils.lora import (
    adapter_metric_name,
    lora_adapter_count,
    policy_adapters,
    qualified_name,
    saved_adapter_name,
)

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
    names = peft_adapter_names(args)
    try:
        model = get_peft_model(model, config, adapter_name=names[0])
    except ValueError as error:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"--target-modules {' '.join(targets)}: {error}") from None
    for name in names[1:]:
        model.add_adapter(name, config)
    for name, param in model.named_parameters():  # peft leaves only the first adapter trainable
        if any(f".{adapter}." in name for adapter in names):
            param.requires_grad_(True)
    return model


def peft_adapter_names(args: Namespace) -> list[str]:
    """The peft model's adapter names: peft's "default" for one adapter, else the engines' names."""
    return ["default"] if lora_adapter_count(args) == 1 else policy_adapters(args)


def adapter_config(model: PeftModel, adapter: str | None = None) -> dict:
    """The adapter's `adapter_config.json` contents (targets resolved to leaf names), as peft saves them (the first
    adapter's unless `adapter` names one; under --multi-lora-n-adapters they all have the same)."""
    config = model.peft_config[adapter or next(iter(model.peft_config))].to_dict()
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
    """(PEFT saved name, full adapter tensor), a collective over the FSDP group: every rank iterates to the end.

    With several adapters each name has its adapter's in front (`slime.utils.lora.qualified_name`)."""
    adapters = list(model.peft_config)
    reshard(model)
    for name, param in model.named_parameters():
        if param.requires_grad:
            adapter = next(a for a in adapters if f".{a}." in name)
            saved = saved_adapter_name(name, adapter)
            full = param.full_tensor() if isinstance(param, DTensor) else param
            yield (
                saved if len(adapters) == 1 else qualified_name(adapter, saved),
                full.detach().to(dtype or full.dtype).contiguous(),
            )


def adapter_parameters(model: nn.Module, adapter: str) -> list[nn.Parameter]:
    """The parameters of one named adapter."""
    return [param for name, param in model.named_parameters() if f".{adapter}." in name]


def activate_adapter(model: nn.Module, adapter: str) -> None:
    """Make `adapter` the one the model computes with. Unlike peft's `set_adapter`, every adapter's parameters stay
    trainable: an FSDP2 unit keeps one set of trainable parameters, and the others get no gradient anyway."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module._active_adapter = adapter
    model.base_model.active_adapter = adapter


def adapter_optimizers(args: Namespace, model: nn.Module, adapters: list[str]) -> list[tuple]:
    """(optimizer, LR scheduler) of each adapter, over that adapter's parameters only (`build_optimizer` and
    `build_lr_scheduler` of the flags, as for one adapter)."""
    pairs = []
    for adapter in adapters:
        own = {id(param) for param in adapter_parameters(model, adapter)}
        others = [param for param in model.parameters() if param.requires_grad and id(param) not in own]
        for param in others:  # build_optimizer takes the trainable parameters
            param.requires_grad_(False)
        try:
            optimizer = build_optimizer(args, model)
        finally:
            for param in others:
                param.requires_grad_(True)
        pairs.append((optimizer, build_lr_scheduler(args, optimizer)))
    return pairs


def adapter_shards(data: dict, count: int) -> list[dict]:
    """This rank's rollout shard cut into one shard per adapter, by `data["lora_adapters"]`.

    The shard holds `num_steps` optimizer steps of equal size back to back (`split_train_data_by_dp`); each step
    must hold one adapter's samples, since the rollout puts the adapters' groups one after the other and each fills
    whole global batches. An adapter's shard has its steps (`num_steps` of them; 0 when it has none).

    Raises:
        ValueError: the rollout data names no adapters, or a step mixes two adapters' samples.
    """
    adapters = data.get("lora_adapters")
    if adapters is None:
        raise ValueError(
            "--multi-lora-n-adapters: the rollout data has no lora_adapters (each sample's adapter); the default "
            "rollout and train data conversion record it from Sample.lora_adapter"
        )
    size, steps = len(adapters), data["num_steps"]
    per_step = size // steps
    owners = []
    for step in range(steps):
        found = set(adapters[step * per_step : (step + 1) * per_step])
        if len(found) != 1:
            raise ValueError(
                f"optimizer step {step} of the rollout holds the samples of adapters {sorted(found)}: each adapter's "
                "samples must fill whole global batches (--rollout-batch-size x --n-samples-per-prompt a multiple of "
                "--global-batch-size, and a generate function returning one sample per request)"
            )
        owners.append(found.pop())
    shards = []
    for adapter in range(count):
        picked = [
            i
            for step, owner in enumerate(owners)
            if owner == adapter
            for i in range(step * per_step, (step + 1) * per_step)
        ]
        shard = {
            key: [value[i] for i in picked] if isinstance(value, list) and len(value) == size else value
            for key, value in data.items()
        }
        shard["num_steps"] = owners.count(adapter)
        shards.append(shard)
    return shards


def train_each_adapter(actor, rollout_id: int, rollout_data, train_one: Callable) -> dict[str, float]:
    """Train every adapter on its own samples of the rollout (`adapter_shards`), one after the other, each with its
    own optimizer and scheduler: `train_one(rollout_id, shard)` is the one-adapter recipe (`TrainRayActor.train`).

    Returns:
        Each adapter's `train/adapter_<k>/<name>`; `train/<name>` the mean over the adapters that trained; the
        `perf/` phase times summed, peak memory the largest, other perf figures the mean.
    """
    import ray

    if isinstance(rollout_data, ray.ObjectRef):
        rollout_data = ray.get(rollout_data)
    shards = adapter_shards(rollout_data, len(actor.adapters))
    by_name: dict[str, list[float]] = {}
    metrics: dict[str, float] = {}
    try:
        for k, (adapter, shard) in enumerate(zip(actor.adapters, shards, strict=True)):
            if shard["num_steps"] == 0:  # the same on every rank: the layout of the steps is global
                continue
            activate_adapter(actor.model, adapter)
            actor.optimizer, actor.lr_scheduler = actor.adapter_optimizers[k]
            for name, value in train_one(rollout_id, shard).items():
                by_name.setdefault(name, []).append(value)
                if name.startswith("train/"):
                    metrics[adapter_metric_name(name, k)] = value
    finally:
        activate_adapter(actor.model, actor.adapters[0])
        actor.optimizer, actor.lr_scheduler = actor.adapter_optimizers[0]
    for name, values in by_name.items():
        if name.startswith("perf/") and name.endswith("_time"):
            metrics[name] = sum(values)
        elif "peak_memory" in name:
            metrics[name] = max(values)
        else:
            metrics[name] = sum(values) / len(values)
    return metrics


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
