"""Build megatron-core GPT models (and their DDP wrappers and optimizer) from Megatron flags.

With TransformerEngine and a GPU the TE layer spec is used; otherwise megatron-core's local spec
(plain torch modules), which is what runs on CPU. Both name the checkpoint keys the same way, so
checkpoints move between them; their parameter names differ only in where the layer norms live
(`self_attention.linear_qkv.layer_norm_weight` with TE, `input_layernorm.weight` locally), and the
converters accept both.

Typical use in a trainer process (torch.distributed already initialized):

    initialize_model_parallel_from_args(args)
    model = build_model(args)                  # list of DDP-wrapped chunks (one per virtual stage)
    optimizer = build_optimizer(args, model)
    load_checkpoint(args.load, model, optimizer)   # checkpoint.py: torch_dist or HF folder

`build_model(args, role="critic")` builds the PPO critic: the same backbone with a value head (critic.py).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import nn

from slime.backends.megatron_utils.config import (
    args_padded_vocab_size,
    megatron_flag,
    transformer_config_from_args,
    use_transformer_engine,
)
from slime.backends.megatron_utils.unwrap import unwrap_model
from slime.utils.device import cuda_available
from slime.utils.misc import load_function


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    virtual_pipeline_model_parallel_size: int | None = None,
    seed: int = 1234,
) -> None:
    """Create Megatron's parallel groups and seed its RNG tracker; torch.distributed must be initialized.

    Args:
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
        expert_model_parallel_size, expert_tensor_parallel_size, virtual_pipeline_model_parallel_size:
            as the Megatron flags of the same names; data parallel takes the remaining ranks.
        seed: seeds torch and the model-parallel RNG stream (dropout inside TP regions).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def initialize_model_parallel_from_args(args: argparse.Namespace) -> None:
    """`initialize_model_parallel` with the sizes and seed of the Megatron flags on `args`."""
    config = transformer_config_from_args(args)
    initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=config.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        seed=megatron_flag(args, "seed", 1234),
    )


def gpt_layer_spec(args: argparse.Namespace, config, vp_stage: int | None = None):
    """The decoder block spec: `--spec MODULE FUNCTION` if given, else TE or local megatron-core layers.

    `FUNCTION(args, config, vp_stage)` returns a layer or block spec (e.g. GLM4's extra layer norms).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = megatron_flag(args, "spec")
    if spec:
        module, function = spec if isinstance(spec, list) else str(spec).split()
        return load_function(f"{module}.{function}")(args, config, vp_stage)
    if megatron_flag(args, "post_self_attn_layernorm", False) or megatron_flag(args, "post_mlp_layernorm", False):
        raise ValueError(
            "--post-self-attn-layernorm/--post-mlp-layernorm (GLM4) need a layer spec that has those norms: "
            "pass --spec MODULE FUNCTION; megatron-core's own specs do not have them."
        )
    return get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=use_transformer_engine(args),
        normalization=config.normalization,
        vp_stage=vp_stage,
    )


def _position_embedding_type(args: argparse.Namespace) -> str:
    if megatron_flag(args, "position_embedding_type"):
        return args.position_embedding_type
    return "rope" if megatron_flag(args, "use_rotary_position_embeddings", False) else "learned_absolute"


def build_gpt_model(
    args: argparse.Namespace,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config=None,
):
    """One megatron-core `GPTModel` (one pipeline stage / virtual stage) from Megatron flags.

    Model parallel state must be initialized (`initialize_model_parallel`) with the sizes on `args`.

    Args:
        args: Megatron flags (`config_from_hf(...)` or slime's parsed args).
        pre_process: this stage holds the embedding.
        post_process: this stage holds the final norm and output layer.
        vp_stage: virtual pipeline stage index, or None without virtual pipelining.
        config: a `TransformerConfig` to use instead of building one from `args`.

    Returns:
        the GPTModel, on the current CUDA device with a GPU, else on the CPU; logits come out
        vocab-parallel ([batch, seq, padded_vocab / TP]); padded vocabulary rows have zero weights.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    config = config or transformer_config_from_args(args)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp != config.tensor_model_parallel_size:
        raise ValueError(
            f"--tensor-model-parallel-size is {config.tensor_model_parallel_size} but the initialized model "
            f"parallel state has {tp}; call initialize_model_parallel_from_args(args) first."
        )
    spec = gpt_layer_spec(args, config, vp_stage)
    mtp_spec = None
    if config.mtp_num_layers:
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine(args), vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args_padded_vocab_size(args),
        max_sequence_length=megatron_flag(args, "max_position_embeddings") or megatron_flag(args, "seq_length") or 4096,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not megatron_flag(args, "untie_embeddings_and_output_weights", False),
        position_embedding_type=_position_embedding_type(args),
        rotary_percent=float(megatron_flag(args, "rotary_percent") or 1.0),
        rotary_base=int(megatron_flag(args, "rotary_base") or 10000),
        rope_scaling=bool(megatron_flag(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(megatron_flag(args, "rope_scaling_factor") or 8.0),
        seq_len_interpolation_factor=megatron_flag(args, "rotary_seq_len_interpolation_factor"),
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
    )


def build_model(args: argparse.Namespace, wrap_with_ddp: bool = True, role: str = "actor") -> list[nn.Module]:
    """All model chunks of this rank (one per virtual pipeline stage), ready for `build_optimizer`.

    `--custom-model-provider-path` replaces `build_gpt_model` with `f(pre_process, post_process, vp_stage)`.
    With --bf16/--fp16 each chunk is wrapped in `Float16Module`; with `wrap_with_ddp` then in Megatron's
    `DistributedDataParallel` (grads in `param.main_grad`, reduced by `finalize_model_grads`).

    Args:
        args: Megatron flags; the model parallel state must already match them.
        wrap_with_ddp: False for a forward-only model (reference, conversion tools).
        role: "actor" (LM head: vocab-parallel logits) or "critic" (untied embeddings, no MTP, and a
            zero-initialized value head on the last stage: `[b, s, 1]` values; see critic.py).

    Returns:
        the list of chunks (length 1 without virtual pipelining).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from slime.backends.megatron_utils.critic import attach_value_head, critic_model_args

    if role not in ("actor", "critic"):
        raise ValueError(f"unknown role {role!r}; use 'actor' or 'critic'")
    if role == "critic":
        args = critic_model_args(args)
    config = transformer_config_from_args(args)
    custom = megatron_flag(args, "custom_model_provider_path")
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks: list[nn.Module] = []
    for vp_stage in range(vpp) if vpp else [None]:
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        if custom:
            model = load_function(custom)(pre, post, vp_stage)
        else:
            model = build_gpt_model(args, pre, post, vp_stage, config=config)
        if role == "critic" and post:
            attach_value_head(model)  # before Float16Module, which casts every parameter
        if cuda_available():
            model.cuda(torch.cuda.current_device())
        if config.fp16 or config.bf16:
            model = Float16Module(config, model)
        chunks.append(model)
    return wrap_in_ddp(args, chunks) if wrap_with_ddp else chunks


def wrap_in_ddp(args: argparse.Namespace, chunks: list[nn.Module]) -> list[nn.Module]:
    """Wrap `build_model(args, wrap_with_ddp=False)`'s chunks in Megatron's `DistributedDataParallel`.

    DDP allocates gradient buffers for the parameters that are trainable now: freeze or add parameters (e.g. LoRA
    adapters, lora.py) before.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = unwrap_model(chunks[0]).config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(megatron_flag(args, "accumulate_allreduce_grads_in_fp32", False)),
        overlap_grad_reduce=bool(megatron_flag(args, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(megatron_flag(args, "overlap_param_gather", False)),
        use_distributed_optimizer=bool(megatron_flag(args, "use_distributed_optimizer", False)),
        check_for_nan_in_grad=not megatron_flag(args, "no_check_for_nan_in_loss_and_grad", False),
        bucket_size=megatron_flag(args, "ddp_bucket_size"),
    )
    return [
        # Only the first chunk buckets its grads, as Megatron-LM does (later chunks overlap poorly).
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]


def build_optimizer(args: argparse.Namespace, model: list[nn.Module]):
    """Megatron's optimizer over DDP-wrapped chunks; OptimizerConfig fields are read from `args` by name.

    Args:
        args: --optimizer, --lr, --min-lr, --weight-decay, --adam-beta1/2, --adam-eps, --clip-grad,
            --bf16/--fp16, --use-distributed-optimizer, ... (Megatron's names).
        model: the chunks from `build_model(args)`.

    Returns:
        a `MegatronOptimizer` (`.step()` returns (success, grad_norm, num_zeros)).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    fields = {f.name for f in dataclasses.fields(OptimizerConfig)} - {"timers"}
    kwargs = {name: megatron_flag(args, name) for name in fields if megatron_flag(args, name) is not None}
    config = transformer_config_from_args(args)
    kwargs.update(params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16)
    return get_megatron_optimizer(OptimizerConfig(**kwargs), model)
