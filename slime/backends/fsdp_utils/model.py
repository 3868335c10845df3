"""Build, shard and drive the FSDP trainer's model: a HuggingFace causal LM (actor) or the same
backbone with a scalar value head (critic), sharded with FSDP2 `fully_shard`.

Sharding: each decoder layer (the classes HF lists in `_no_split_modules`) is its own FSDP unit,
then the root, so embeddings, final norm and LM head live in the root unit (tied embeddings stay
tied). Parameters become DTensors sharded on dim 0 over a 1-D mesh of all ranks; on CPU the mesh
is a "cpu" mesh over gloo, which FSDP2 supports at any world size. A single rank is not sharded
at all unless FSDP casts its parameters (`--bf16` on GPU; see `shard_model`); everything below
accepts plain tensors as well as DTensors.

Precision: float32 everywhere by default (bf16 matmuls are ~200x slower on AVX2-only CPUs). With
`--bf16` the forward and backward compute in bf16 while weights, gradients and optimizer state stay
float32: on GPU through FSDP2's mixed-precision policy, on CPU under `torch.autocast`, where the
matmuls run on the CPU's bf16 units (AMX, AVX512-BF16) and attention stays float32.

Vision-language checkpoints (a `vision_config` in config.json: Qwen2.5-VL, Qwen3-VL, ...) load as
`AutoModelForImageTextToText`; their micro-batches carry the images and M-RoPE positions
(data_packing.add_vision_inputs), and the vision tower stays frozen unless `--train-vision-tower`.

Weight swaps (the reference model) act on each rank's local shard of every parameter:
`local_shards` returns tensors that alias the parameters' storage, so `copy_` into them changes
the live model without reallocating anything.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from argparse import Namespace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AttentionInterface, AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from slime.backends.fsdp_utils.data_packing import PackedMicroBatch, VisionBatching
from slime.utils.device import default_device
from slime.utils.misc import load_pretrained, load_tokenizer
from slime.utils.processing_utils import is_vision_language, load_image_processor, load_processor

LR_DECAY_STYLES = ("constant", "linear", "cosine")
# Parameter names of a vision tower (with its merger / projector) in HF's vision-language models.
VISION_TOWER_PATTERN = re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")


def training_device() -> torch.device:
    """The current CUDA device when there is one, else CPU."""
    return default_device()


def _sdpa_in_float32(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
    # On CPU the bf16 flash-attention backward runs ~4.7x slower than the float32 one (22 vs 4.7 ms at
    # 8 rows x 9 heads x 64 tokens, one thread), so under bf16 autocast attention stays float32.
    with torch.autocast("cpu", enabled=False):
        return sdpa_attention_forward(module, query.float(), key.float(), value.float(), *args, **kwargs)


# HF's "sdpa" computed in float32 whatever the autocast (`use_float32_attention`).
SDPA_FLOAT32 = "sdpa_float32"
AttentionInterface.register(SDPA_FLOAT32, _sdpa_in_float32)
AttentionMaskInterface.register(SDPA_FLOAT32, sdpa_mask)


def use_float32_attention(model: nn.Module) -> None:
    """Run an sdpa model's attention in float32 under bf16 autocast (`SDPA_FLOAT32`); other kernels stay.

    With `--bf16` on CPU the trainer's forwards run under `torch.autocast("cpu", torch.bfloat16)`: matmuls
    in bf16 from float32 weights (each weight cast once per forward, each gradient cast back), so weights,
    gradients and optimizer state stay float32 and FSDP needs no mixed-precision policy. On one core of
    an AMX Xeon a SmolLM2-135M forward and backward over 512 tokens took 1.8 s that way, 4.0 s in float32.
    """
    hf_model = model.backbone if isinstance(model, ValueModel) else model
    if hf_model.config._attn_implementation == "sdpa":
        hf_model.set_attn_implementation(SDPA_FLOAT32)


def is_hf_folder(path: str | None) -> bool:
    """True when `path` is a HuggingFace model folder (it holds a config.json)."""
    return bool(path) and os.path.isfile(os.path.join(path, "config.json"))


class ValueModel(nn.Module):
    """Critic: a HF decoder backbone plus a linear head giving one value per position.

    Args:
        backbone: The base model (`AutoModel`), returning `last_hidden_state`.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        # Values start at exactly 0: the first returns then set the scale, not a random head.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **vision_inputs: torch.Tensor,
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **vision_inputs,
        ).last_hidden_state
        # A copy, not a view: FSDP2 attaches its pre-backward hook to the root's output.
        return self.value_head(hidden).squeeze(-1).clone()


def load_model(
    path: str,
    role: str = "actor",
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load an unsharded float32 model from a HF folder on CPU.

    Args:
        path: HF model folder.
        role: "actor" (causal LM; image-text-to-text for a vision-language model) or "critic" (`ValueModel` on
            the same backbone; the LM head is dropped).
        gradient_checkpointing: Recompute each decoder layer's activations in backward.
        attn_implementation: HF attention implementation ("sdpa", "eager", "flash_attention_2"); None: the default.
        trust_remote_code: Let transformers run Python code shipped in the folder (`--trust-remote-code`).

    Returns:
        The model, in train mode.
    """
    if not is_hf_folder(path):
        raise ValueError(f"{path!r} is not a HuggingFace model folder (no config.json); check --hf-checkpoint / --load")
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if role == "actor":
        config = load_pretrained(AutoConfig, path, trust_remote_code)
        loader = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        model = load_pretrained(loader, path, trust_remote_code, dtype=torch.float32, **kwargs)
        hf_model = model
    elif role == "critic":
        hf_model = load_pretrained(AutoModel, path, trust_remote_code, dtype=torch.float32, **kwargs)
        model = ValueModel(hf_model)
    else:
        raise ValueError(f"unknown role {role!r}; use 'actor' or 'critic'")
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}  # the non-reentrant form composes with FSDP's forward hooks
        if hasattr(hf_model, "activation_checkpointing_enable"):
            hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()


def freeze_vision_tower(model: nn.Module) -> list[str]:
    """Turn `requires_grad` off for the vision tower's parameters (names matching `VISION_TOWER_PATTERN`).

    Returns:
        The names frozen.

    Raises:
        ValueError: the model has no parameter named like a vision tower.
    """
    frozen = [name for name, param in model.named_parameters() if VISION_TOWER_PATTERN.search(name)]
    if not frozen:
        raise ValueError(f"{type(model).__name__} has no vision tower parameters (visual.*, vision_tower.*) to freeze")
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return frozen


def vision_batching(model: nn.Module, multimodal_train_inputs: list | None, num_samples: int) -> VisionBatching | None:
    """How a vision-language `model` lays out its micro-batches (`data_packing.VisionBatching`), given each of the
    `num_samples` samples' `multimodal_train_inputs` (None: no sample has images); None for a text-only model."""
    if not is_vision_language(model.config):
        return None
    # The critic's backbone is the inner VL model itself; the actor wraps it with the LM head.
    inner = model.backbone if isinstance(model, ValueModel) else model.model
    inputs = list(multimodal_train_inputs) if multimodal_train_inputs is not None else [None] * num_samples
    return VisionBatching(inputs, inner.get_rope_index, int(model.config.image_token_id))


def select_trainable_parameters(
    model: nn.Module, only_train: list[str] | None = None, freeze: list[str] | None = None
) -> list[str]:
    """Turn `requires_grad` off by name: `only_train` keeps only matching parameters trainable, then `freeze`
    freezes matching ones (`--only-train-params-name-list`, `--freeze-params-name-list`).

    A pattern matches a parameter when `re.search(pattern, name)` finds it, so a plain substring works.

    Returns:
        The names of the parameters left trainable.

    Raises:
        ValueError: A pattern matches no parameter, or nothing is left to train.
    """
    names = [name for name, _ in model.named_parameters()]
    for flag, patterns in (("--only-train-params-name-list", only_train), ("--freeze-params-name-list", freeze)):
        for pattern in patterns or []:
            if not any(re.search(pattern, name) for name in names):
                raise ValueError(
                    f"{flag}: {pattern!r} matches no parameter of the model; names look like "
                    f"{', '.join(names[:3])}, ..."
                )
    for name, param in model.named_parameters():
        trainable = not only_train or any(re.search(p, name) for p in only_train)
        if trainable and freeze and any(re.search(p, name) for p in freeze):
            trainable = False
        param.requires_grad_(trainable)
    kept = [name for name, param in model.named_parameters() if param.requires_grad]
    if not kept:
        raise ValueError(
            "--only-train-params-name-list / --freeze-params-name-list leave no parameter to train; loosen them"
        )
    return kept


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules whose class HF names in `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"found no decoder layers to shard in {type(model).__name__} (no _no_split_modules)")
    return layers


def shard_model(model: nn.Module, world_size: int, bf16: bool = False) -> tuple[nn.Module, DeviceMesh]:
    """Move the model to the training device and shard it with FSDP2: each decoder layer, then the root.

    A single rank is left unsharded unless FSDP casts its parameters (bf16 on GPU): FSDP would only copy every parameter into an
    unsharded buffer before each forward and backward, and every gradient back (measured on CPU:
    about 0.3 s per micro-batch of SmolLM2-135M), for nothing to share.

    Args:
        model: Unsharded model from `load_model`.
        world_size: Ranks of the default process group (the data-parallel size).
        bf16: Compute in bfloat16 with float32 master weights and gradient reduction (on GPU; on CPU
            the actor computes under autocast and the shards stay float32: `use_float32_attention`).

    Returns:
        (the sharded model, its 1-D device mesh).
    """
    device = training_device()
    mesh = init_device_mesh(device.type, (world_size,))
    model.to(device)
    bf16 = bf16 and device.type == "cuda"
    if world_size == 1 and not bf16:
        return model, mesh
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh} | ({"mp_policy": policy} if policy is not None else {})
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model, mesh


def build_optimizer(args: Namespace, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW from `--lr`, `--adam-beta1/2`, `--adam-eps`, `--weight-decay`.

    The fused kernel updates each parameter in one pass with no temporaries: for SmolLM2-135M on one
    CPU core a step took 0.16 s and no extra memory, against 0.65 s and a 0.5 GiB peak for the
    default multi-tensor (foreach) form.
    """
    if args.optimizer != "adam":
        raise ValueError(f"the FSDP backend supports --optimizer adam only, got {args.optimizer!r}")
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
        fused=True,
    )


def lr_at_step(
    step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int | None, style: str
) -> float:
    """Learning rate of optimizer step `step` (0-based), Megatron's schedule.

    Linear warm-up over `warmup_steps` steps (`max_lr * (step + 1) / warmup_steps`), then `style`
    decay from `max_lr` to `min_lr` at step `decay_steps`, then `min_lr`.

    Args:
        step: Optimizer steps taken so far.
        max_lr: `--lr`.
        min_lr: `--min-lr`.
        warmup_steps: `--lr-warmup-iters` (or the fraction of the decay steps).
        decay_steps: Step where decay ends; may be None for "constant".
        style: "constant", "linear" or "cosine".

    Returns:
        The learning rate.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if style == "constant":
        return max_lr
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(decay_steps - warmup_steps, 1)
    if style == "linear":
        return max_lr - (max_lr - min_lr) * ratio
    return min_lr + (max_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * ratio))


def build_lr_scheduler(args: Namespace, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_at_step` as a LambdaLR; one scheduler step per optimizer step.

    The decay length is `--lr-decay-iters`, else `--num-rollout x --num-steps-per-rollout`.
    """
    style = args.lr_decay_style
    if style not in LR_DECAY_STYLES:
        raise ValueError(f"--lr-decay-style {style} is not supported by the FSDP backend; use one of {LR_DECAY_STYLES}")
    decay_steps = args.lr_decay_iters
    if decay_steps is None and args.num_rollout:
        decay_steps = args.num_rollout * args.num_steps_per_rollout
    if style != "constant" and not decay_steps:
        raise ValueError(f"--lr-decay-style {style} needs the decay length: pass --lr-decay-iters or --num-rollout")
    if args.lr_warmup_fraction is not None:
        if not decay_steps:
            raise ValueError("--lr-warmup-fraction needs --lr-decay-iters or --num-rollout; or use --lr-warmup-iters")
        warmup_steps = int(args.lr_warmup_fraction * decay_steps)
    else:
        warmup_steps = args.lr_warmup_iters
    max_lr, min_lr = args.lr, args.min_lr

    def factor(step: int) -> float:
        return lr_at_step(step, max_lr, min_lr, warmup_steps, decay_steps, style) / max_lr if max_lr > 0 else 0.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------
# Forward passes on packed micro-batches
# ---------------------------------------------------------------------------------------------


def response_logits(model: nn.Module, micro_batch: PackedMicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """Logits predicting the micro-batch's response tokens, divided by the sampling temperature.

    Only the positions that predict some response token (in any row) go through the LM head
    (`logits_to_keep` with indices).

    Returns:
        `[M, vocab]` float32 logits, row `j` predicting `micro_batch.target_tokens[j]`.
    """
    columns, column_index = torch.unique(micro_batch.logit_positions, return_inverse=True)
    output = model(
        input_ids=micro_batch.input_ids,
        position_ids=micro_batch.position_ids,
        attention_mask=micro_batch.attention_mask,
        use_cache=False,
        logits_to_keep=columns,
        **(micro_batch.vision_inputs or {}),
    )
    logits = output.logits[micro_batch.logit_rows, column_index].float()
    return logits / temperature if temperature != 1.0 else logits


def response_values(model: nn.Module, micro_batch: PackedMicroBatch) -> torch.Tensor:
    """Critic values at the positions that predict each response token (the state before it).

    Returns:
        `[M]` float32 values.
    """
    values = model(
        input_ids=micro_batch.input_ids,
        position_ids=micro_batch.position_ids,
        attention_mask=micro_batch.attention_mask,
        **(micro_batch.vision_inputs or {}),
    )
    return values[micro_batch.logit_rows, micro_batch.logit_positions].float()


# ---------------------------------------------------------------------------------------------
# Sharded weights: local shards, full state dicts
# ---------------------------------------------------------------------------------------------


def reshard(model: nn.Module) -> None:
    """Put every FSDP unit back in its sharded state.

    FSDP2 keeps the root unit's parameters unsharded after a forward without backward (it expects
    the backward to need them), and `named_parameters` then yields the gathered full tensors.
    Anything that reads or writes shards calls this first.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter, aliasing the parameter storage (tied weights once)."""
    reshard(model)
    return {
        name: param.to_local() if isinstance(param, DTensor) else param.data for name, param in model.named_parameters()
    }


def snapshot_local_shards(model: nn.Module, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Copy every local shard to CPU; reuse the tensors of `into` when given (no new allocation)."""
    shards = local_shards(model)
    if into is None:
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in shards.items()}
    with torch.no_grad():
        for name, tensor in shards.items():
            into[name].copy_(tensor)
    return into


@torch.no_grad()
def load_local_shards(model: nn.Module, shards: dict[str, torch.Tensor]) -> None:
    """Copy `shards` (from `snapshot_local_shards` or `shard_full_state_dict`) into the live parameters."""
    for name, tensor in local_shards(model).items():
        tensor.copy_(shards[name])


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of the model's state dict; a collective, every rank must call it.

    Tied parameters are gathered once and appear under each of their names.

    Args:
        model: The sharded model.

    Returns:
        name -> full CPU tensor (never aliasing the live parameters), on every rank.
    """
    reshard(model)
    gathered: dict[int, torch.Tensor] = {}
    full = {}
    for name, tensor in model.state_dict().items():
        key = id(tensor)
        if key not in gathered:
            value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            # With one CPU rank the "gathered" tensor can be the parameter's own storage; copy it then,
            # so the result is a snapshot that later optimizer steps do not change.
            aliases = value.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
            gathered[key] = value.detach().to("cpu", copy=aliases)
        full[name] = gathered[key]
    return full


def shard_full_state_dict(model: nn.Module, full_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's CPU shard of each parameter, cut from full tensors every rank holds (no communication)."""
    reshard(model)
    shards = {}
    for name, param in model.named_parameters():
        if name not in full_state_dict:
            raise ValueError(f"the weights to load lack parameter {name!r}")
        full = full_state_dict[name].to(param.device, param.dtype)
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"parameter {name!r}: weights have shape {list(full.shape)}, model {list(param.shape)}")
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        shards[name] = full.cpu()
    return shards


def read_hf_state_dict(path: str, role: str) -> dict[str, torch.Tensor]:
    """Full state dict of a HF folder, named as the model `load_model(path, role)` builds."""
    return load_model(path, role).state_dict()


def save_hf_folder(
    model: nn.Module,
    full_state_dict: dict[str, torch.Tensor],
    path: str,
    tokenizer_path: str | None,
    trust_remote_code: bool = False,
) -> None:
    """Write a HF folder (config, safetensors weights, generation config, tokenizer) from full weights.

    A plain copy of the model class is built on the meta device and given the tensors, so
    `config.architectures` names the HF class rather than FSDP's wrapper class. A vision-language model also gets its
    source folder's image processor and processor chat template (`_save_processor_files`), without which the export
    cannot be loaded back as a VLM.

    Args:
        model: The sharded actor (its config is used).
        full_state_dict: From `gather_full_state_dict`.
        path: Output folder (created).
        tokenizer_path: Folder whose tokenizer (and, for a VLM, processor) is saved alongside (skipped when None).
        trust_remote_code: The model's or tokenizer's classes come from the model folder (`--trust-remote-code`).
    """
    loader = AutoModelForImageTextToText if is_vision_language(model.config) else AutoModelForCausalLM
    with torch.device("meta"):
        plain = loader.from_config(model.config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    plain.load_state_dict(full_state_dict, strict=False, assign=True)
    plain.tie_weights()
    plain.save_pretrained(path, safe_serialization=True)
    if tokenizer_path is not None:
        load_tokenizer(tokenizer_path, trust_remote_code).save_pretrained(path)
        if is_vision_language(model.config):
            _save_processor_files(tokenizer_path, path, trust_remote_code)


def _save_processor_files(source: str, path: str, trust_remote_code: bool) -> None:
    """Save `source`'s processor into `path`: the whole processor where transformers can build it, else (Qwen-VL
    processors need torchvision) its image processor and a copy of the processor's chat template files."""
    processor = load_processor(source, trust_remote_code=trust_remote_code)
    if processor is not None:
        processor.save_pretrained(path)
        return
    load_image_processor(source, trust_remote_code).save_pretrained(path)
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
