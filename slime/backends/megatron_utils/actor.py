"""Megatron training rank: a megatron-core GPTModel (TP/PP/CP/EP, DDP, distributed optimizer) trained on
rollout data and synced to the engines under HuggingFace names; or, with role "critic", PPO's value model.

The driver protocol and the per-rollout recipe are the backend-neutral `TrainRayActor`'s
(slime/backends/train_actor.py); this file builds the model and runs every pass (log-probs, values,
training) over the same packed micro-batches through Megatron's forward-backward schedule (pipeline
parallel aware). The reference weights are copied into the one model and back, as upstream's tensor
backuper does: no second model.

Data: the driver splits a rollout into one shard per data-parallel rank and `RayTrainGroup` gives
every rank of a model-parallel group (TP x PP x CP) the shard of its data-parallel rank
(`actor_group.data_parallel_rank`); data-parallel collectives run over Megatron's data-parallel group.

Critic: the same backbone, loaded from the same HF weights but for the LM head, with a zero-initialized
value head (critic.py) giving one value per position; a response token's value is the one at the
position predicting it, as in the FSDP critic.

LoRA (`--lora-rank`, lora.py): the base is loaded from `--hf-checkpoint`, frozen, and adapters are added before
DDP wraps the chunks, so gradient buffers and the optimizer hold the adapters only. The reference is the base (the
adapters switched off), a weight update pushes the adapter under PEFT saved names, and checkpoints hold the
adapter and its optimizer state plus a PEFT folder (checkpoint.py); what LoRA changes in the recipe is
`TrainRayActor`'s.

Loss scaling: the loss of a micro-batch is this data-parallel rank's share of the global-batch
value (`loss.StepNormalizer`). Megatron's schedule divides it by the micro-batch count (and
multiplies by the CP size) and DDP averages gradients over data x context ranks, so the trainer
multiplies by micro-batches x DP size: the gradient is then that of the global-batch loss, as in FSDP.

On a machine without CUDA, megatron-core runs through `cpu_compat.apply_cpu_patch` (gloo, fp32,
local layer spec): never load transformers models in this process there.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from argparse import Namespace
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist

from slime.algorithms.aggregation import StepNormalizer
from slime.backends.megatron_utils import checkpoint, lora
from slime.backends.megatron_utils.config import (
    args_vocab_size,
    config_from_hf,
    megatron_flag,
    model_family,
    use_transformer_engine,
)
from slime.backends.megatron_utils.cp_utils import gather_zigzag, zigzag_positions, zigzag_slice
from slime.backends.megatron_utils.critic import load_backbone_from_hf
from slime.backends.megatron_utils.data import PackedMicroBatch, build_step_micro_batches
from slime.backends.megatron_utils.loss import LOSS_FUNCTIONS, ResponseOutputs, log_probs_and_entropy
from slime.backends.megatron_utils.model import (
    build_model,
    build_optimizer,
    initialize_model_parallel_from_args,
    wrap_in_ddp,
)
from slime.backends.megatron_utils.mtp import forward_with_mtp, mtp_cross_entropy, mtp_loss_mask
from slime.backends.megatron_utils.parallel import named_weights
from slime.backends.megatron_utils.routing_replay import local_routing, moe_routers, set_replay
from slime.backends.megatron_utils.unwrap import unwrap_model
from slime.backends.megatron_utils.update_weight import adapter_buckets, hf_weight_buckets
from slime.backends.storage_offload import ReleasedStorages, release_storages, restore_storages
from slime.backends.train_actor import TrainRayActor, Weights
from slime.utils.device import cuda_available
from slime.utils.lora import ADAPTER_WEIGHTS_FILE
from slime.utils.micro_batches import split_per_sample
from slime.utils.misc import release_free_host_memory
from slime.utils.weight_sync import Bucket

logger = logging.getLogger(__name__)

Steps = list[list[PackedMicroBatch]]


def megatron_model_args(args: Namespace) -> Namespace:
    """slime's args plus the model flags: `MODEL_ARGS` when given (`--num-layers` set), else derived
    from the HF config of `--hf-checkpoint`.

    The copy also turns off Megatron's own per-token loss averaging and NaN-gradient error: slime
    normalizes the loss itself and checks the gradient norm in `_optimizer_step`.
    """
    model_args = Namespace(**vars(args))
    if megatron_flag(args, "num_layers") is None:
        if not args.hf_checkpoint:
            raise ValueError(
                "the Megatron backend needs the model flags (source scripts/models/*.sh) or --hf-checkpoint"
            )
        vars(model_args).update(vars(config_from_hf(args.hf_checkpoint)))
    model_args.calculate_per_token_loss = False
    model_args.no_check_for_nan_in_loss_and_grad = True
    return model_args


def build_lr_scheduler(args: Namespace, optimizer):
    """Megatron's `OptimizerParamScheduler` from --lr, --min-lr, --lr-warmup-*, --lr-decay-*, --weight-decay.

    The decay length is `--lr-decay-iters`, else `--num-rollout x --num-steps-per-rollout`.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = args.lr_decay_iters
    if decay_steps is None and args.num_rollout:
        decay_steps = args.num_rollout * args.num_steps_per_rollout
    decay_steps = max(int(decay_steps or 1), 1)
    warmup_fraction = args.lr_warmup_fraction
    warmup_steps = int(warmup_fraction * decay_steps) if warmup_fraction is not None else args.lr_warmup_iters
    if warmup_steps >= decay_steps and args.lr_decay_style != "constant":
        raise ValueError(
            f"--lr-warmup-iters {warmup_steps} must be below the decay length {decay_steps} "
            "(--lr-decay-iters, or --num-rollout x --num-steps-per-rollout)"
        )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=float(megatron_flag(args, "lr_warmup_init") or 0.0),
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
        wsd_decay_steps=megatron_flag(args, "lr_wsd_decay_iters"),
        lr_wsd_decay_style=megatron_flag(args, "lr_wsd_decay_style"),
    )


class MegatronTrainRayActor(TrainRayActor):
    """One Megatron training rank (role "actor" or "critic"); see slime/backends/train_actor.py for the protocol."""

    loss_functions = LOSS_FUNCTIONS

    # ---- setup ---------------------------------------------------------------------------------
    def _build(self, args: Namespace, with_ref: bool) -> int:
        """Build model, optimizer and LR scheduler, load weights; return the rollout id to start from: the
        torch_dist checkpoint's + 1 when resuming from `--load` (the critic's from `<load>/critic`), else 0.
        The critic is the HF backbone plus a zero-initialized value head; under LoRA the model is the base from
        `--hf-checkpoint` with adapters (`_add_adapters`)."""
        if not cuda_available():
            from slime.backends.megatron_utils.cpu_compat import apply_cpu_patch

            apply_cpu_patch()
        from megatron.core import parallel_state

        self.model_args = megatron_model_args(args)
        # --use-rollout-routing-replay: the actor's routers can take the engines' experts (`_model_forward`)
        self.model_args.moe_enable_routing_replay = self.replay_routing
        initialize_model_parallel_from_args(self.model_args)
        self.mpu = parallel_state
        self.family = model_family(self.model_args)
        self.vocab_size = args_vocab_size(self.model_args)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda_available() else None
        self.device = self.device or torch.device("cpu")
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.use_packed_seq_params = use_transformer_engine(self.model_args)
        if self.cp_size > 1 and not self.use_packed_seq_params:
            raise ValueError("--context-parallel-size > 1 needs TransformerEngine attention (a GPU with TE)")

        start_hf = args.load if args.load and checkpoint.is_hf_checkpoint(args.load) else args.hf_checkpoint
        self.model = build_model(self.model_args, role=self.role, wrap_with_ddp=not self.lora)
        if self.lora:
            self.model = self._add_adapters(args, start_hf)
        self.offloaded: dict[str, ReleasedStorages] = {}  # --offload-train: what `offload` released, by part
        for chunk in self.model:
            unwrap_model(chunk).config.variable_seq_lengths = True  # packed rows differ in length
        self.routers = [moe_routers(chunk) for chunk in self.model]
        # --enable-mtp-training (validated with --mtp-num-layers); the critic's model has no MTP layers
        self.mtp_depth = None if self.value_head else megatron_flag(self.model_args, "mtp_num_layers")
        # SGLang's NEXTN draft reads the MTP layers from the pushes; the CPU engine has no draft model to take them.
        self._engines_take_mtp = args.rollout_backend != "cpu"
        if self.replay_routing and not any(self.routers):
            raise ValueError(
                "--use-rollout-routing-replay: no MoE router can replay; the model is dense (drop the flag) or "
                "megatron-core predates RouterReplay (0.16 has it)"
            )
        self.optimizer = build_optimizer(self.model_args, self.model)
        self.lr_scheduler = build_lr_scheduler(args, self.optimizer)

        if with_ref:
            ref_source = args.ref_load or start_hf
            checkpoint.load_checkpoint(
                ref_source, self.model, iteration=self._ref_iteration(ref_source), flag="--ref-load"
            )
            self.ref_weights = self._snapshot_weights()
        if self.value_head:
            load_backbone_from_hf(self.model, start_hf)  # the value head keeps its zeros
        elif not self.lora and (not with_ref or args.ref_load):  # LoRA: `_add_adapters` loaded the base
            checkpoint.load_checkpoint(start_hf, self.model)
        self.optimizer.reload_model_params()  # fp32 main copies of 16-bit params follow the loaded weights
        # What `_step_gradients` computes the loss from: the critic's values or the policy's log-probs and entropy.
        self._training_outputs = self._response_values if self.value_head else self._policy_outputs

        start_rollout_id = 0
        load_root = self._checkpoint_root(args.load)
        if load_root and not checkpoint.is_hf_checkpoint(args.load) and checkpoint.has_checkpoint(load_root):
            finetune = args.finetune
            load_optimizer = not finetune and not args.no_load_optim
            iteration, _ = checkpoint.load_checkpoint(
                load_root,
                self.model,
                self.optimizer if load_optimizer else None,
                None if finetune else self.lr_scheduler,
                adapter_only=self.lora,
            )
            if not load_optimizer:
                self.optimizer.reload_model_params()
            start_rollout_id = 0 if finetune else iteration + 1
            logger.info("rank %d: resumed the %s from %s rollout %d", self.rank, self.role, load_root, iteration)
        return start_rollout_id

    def _add_adapters(self, args: Namespace, base: str) -> list:
        """LoRA: load the base into the unwrapped chunks, freeze it, add the adapters (new, or
        `--lora-adapter-path`'s), then wrap the chunks in DDP, which allocates gradients for the adapters only."""
        checkpoint.load_checkpoint(base, self.model)
        leaves = lora.apply_lora(
            self.model,
            args.lora_rank,
            args.lora_alpha,
            args.lora_dropout,
            args.target_modules,
            args.exclude_modules,
            seed=megatron_flag(args, "seed", 1234),
        )
        if args.lora_adapter_path is not None:
            from safetensors.torch import load_file

            lora.load_adapter_from_hf(self.model, load_file(os.path.join(args.lora_adapter_path, ADAPTER_WEIGHTS_FILE)))
        # Every rank writes the same config: the targets of all pipeline stages.
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, leaves)
        targets = args.target_modules
        if targets == ["all-linear"]:
            targets = sorted({leaf for rank_leaves in every_rank for leaf in rank_leaves})
        self.lora_config = lora.adapter_config(
            args.lora_rank, args.lora_alpha, args.lora_dropout, targets, args.exclude_modules, args.hf_checkpoint
        )
        return wrap_in_ddp(self.model_args, self.model)

    def _ref_iteration(self, source: str) -> int | None:
        if checkpoint.is_hf_checkpoint(source):
            return None
        return self.args.ref_ckpt_step

    def _data_parallel_group(self) -> dist.ProcessGroup:
        return self.mpu.get_data_parallel_group()

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{i}.{name}", tensor) for i, chunk in enumerate(self.model) for name, tensor in named_weights(chunk)]

    def _snapshot_weights(self, into: Weights | None = None) -> Weights:
        with torch.no_grad():
            if into is None:
                return {name: t.detach().to("cpu", copy=True) for name, t in self._named_weights()}
            for name, tensor in self._named_weights():
                into[name].copy_(tensor)
        return into

    @torch.no_grad()
    def _load_weights(self, weights: Weights) -> None:
        for name, tensor in self._named_weights():
            tensor.copy_(weights[name])

    # ---- micro-batches -------------------------------------------------------------------------
    def _micro_batches(self, data: dict) -> Steps:
        dynamic = self.args.use_dynamic_batch_size
        sequence_multiple = 2 * self.cp_size if self.cp_size > 1 else 1
        return build_step_micro_batches(
            data["tokens"],
            data["response_lengths"],
            data["num_steps"],
            micro_batch_size=self.args.micro_batch_size,
            max_tokens=self.args.max_tokens_per_gpu if dynamic else None,
            pad_multiple=self.tp_size * sequence_multiple,
            device=self.device,
            sequence_pad_multiple=sequence_multiple,
            routed_experts=data.get("rollout_routed_experts") if self.replay_routing else None,
        )

    def _probe_micro_batches(self, probe: list[int]) -> Steps:
        return build_step_micro_batches([probe], [len(probe) - 1], 1, 1, None, self.tp_size, self.device)

    # ---- forward through Megatron's schedule -----------------------------------------------------
    def _model_forward(self, chunk, micro_batch: PackedMicroBatch) -> torch.Tensor:
        routers = self.routers[self.model.index(chunk)]
        if routers:  # the routing stays set after the forward: activation recompute reruns the routers
            replay = self.replay_routing and micro_batch.routed_experts is not None
            bounds = micro_batch.cu_seqlens.tolist()
            set_replay(routers, local_routing(micro_batch.routed_experts, bounds, self.mpu) if replay else None)
        input_ids, position_ids = micro_batch.input_ids, micro_batch.position_ids
        if self.cp_size > 1:
            bounds = micro_batch.cu_seqlens.tolist()
            rank = self.mpu.get_context_parallel_rank()
            input_ids = zigzag_slice(input_ids, bounds, self.cp_size, rank)
            position_ids = zigzag_slice(position_ids, bounds, self.cp_size, rank)
        if self.use_packed_seq_params:
            mask, kwargs = None, {"packed_seq_params": micro_batch.packed_seq_params()}
        else:
            mask, kwargs = micro_batch.attention_mask(), {}
        if not self.mtp_depth:
            return chunk(input_ids, position_ids, mask, **kwargs)
        response_mask = micro_batch.response_loss_mask
        if response_mask is None:  # a forward-only pass: the MTP losses are computed and dropped
            response_mask = torch.ones_like(micro_batch.target_tokens)
        mtp_mask = mtp_loss_mask(
            input_ids, micro_batch.cu_seqlens, micro_batch.logit_positions, response_mask, self.mtp_depth
        )
        gpt = unwrap_model(chunk)
        logits, depth_logits = forward_with_mtp(
            chunk, gpt, input_ids, position_ids, mask, mtp_mask, self.vocab_size, **kwargs
        )
        if gpt.training:
            with torch.no_grad():
                micro_batch.mtp_loss = float(mtp_cross_entropy(depth_logits, input_ids, mtp_mask, self.vocab_size))
        return logits

    def _response_outputs(
        self, micro_batch: PackedMicroBatch, logits: torch.Tensor, temperature: float, entropy_grad: bool
    ) -> ResponseOutputs:
        """Log-probs and entropies of the response tokens from the last stage's `[1, n, vocab/TP]` logits."""
        logits = logits[0].float()
        if self.cp_size == 1:
            logits = logits[micro_batch.logit_positions] / temperature
            log_probs, entropy = log_probs_and_entropy(logits, micro_batch.target_tokens, self.vocab_size)
        else:
            # Each CP rank scores its own positions against the next token, then the row is gathered.
            bounds = micro_batch.cu_seqlens.tolist()
            rank = self.mpu.get_context_parallel_rank()
            positions = zigzag_positions(bounds, self.cp_size, rank).to(logits.device)
            row = micro_batch.input_ids[0]
            next_tokens = row[(positions + 1).clamp(max=row.numel() - 1)]
            logits = logits / temperature
            local_lp, local_entropy = log_probs_and_entropy(logits, next_tokens, self.vocab_size)
            group = self.mpu.get_context_parallel_group()
            log_probs = gather_zigzag(local_lp, bounds, self.cp_size, rank, group)[micro_batch.logit_positions]
            entropy = gather_zigzag(local_entropy, bounds, self.cp_size, rank, group)[micro_batch.logit_positions]
        return ResponseOutputs(logits, log_probs, entropy if entropy_grad else entropy.detach())

    def _policy_outputs(self, micro_batch: PackedMicroBatch, logits: torch.Tensor) -> ResponseOutputs:
        """`_response_outputs` at the rollout temperature, the entropy differentiable when the loss uses it."""
        return self._response_outputs(
            micro_batch, logits, self.args.rollout_temperature, entropy_grad=self.args.entropy_coef != 0
        )

    def _response_values(self, micro_batch: PackedMicroBatch, output: torch.Tensor) -> torch.Tensor:
        """Critic: `[M]` float32 values at the positions predicting the response tokens, from the last
        stage's `[1, n, 1]` value-head output (identical on every TP rank; gathered over CP ranks)."""
        values = output[0, :, 0].float()
        if self.cp_size > 1:
            bounds = micro_batch.cu_seqlens.tolist()
            rank = self.mpu.get_context_parallel_rank()
            values = gather_zigzag(values, bounds, self.cp_size, rank, self.mpu.get_context_parallel_group())
        return values[micro_batch.logit_positions]

    def _run_schedule(self, micro_batches: list[PackedMicroBatch], loss_of_output, forward_only: bool) -> None:
        """Run micro-batches through Megatron's forward-backward schedule; `loss_of_output(mb, output)`
        returns (loss, {}) on the last pipeline stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        queue = list(micro_batches)

        def forward_step(data_iterator, chunk):
            micro_batch = next(data_iterator)
            return self._model_forward(chunk, micro_batch), partial(loss_of_output, micro_batch)

        iterators = [iter(queue) for _ in self.model]
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(self.model) > 1 else iterators[0],
            model=self.model,
            num_microbatches=len(queue),
            seq_length=max(mb.input_ids.shape[1] for mb in queue) // self.cp_size,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _forward_log_probs(self, steps: Steps, num_samples: int, temperature: float | None = None) -> list:
        temperature = temperature or self.args.rollout_temperature

        def log_probs(micro_batch, logits):
            return self._response_outputs(micro_batch, logits, temperature, entropy_grad=False).log_probs

        return self._forward_per_sample(steps, num_samples, log_probs)

    def _forward_values(self, steps: Steps, num_samples: int) -> list:
        return self._forward_per_sample(steps, num_samples, self._response_values)

    @torch.no_grad()
    def _forward_per_sample(
        self, steps: Steps, num_samples: int, per_token: Callable[[PackedMicroBatch, torch.Tensor], torch.Tensor]
    ) -> list:
        """`per_token(micro_batch, output)` (`[M]` over the response tokens) split per sample, on CPU.

        With pipeline parallelism the last stage computes them and broadcasts them to its pipeline group.
        """
        for chunk in self.model:
            chunk.eval()
        outputs: list = [None] * num_samples

        def keep(micro_batch, output):
            per_sample = split_per_sample(per_token(micro_batch, output), micro_batch.response_lengths)
            for index, value in zip(micro_batch.sample_indices, per_sample, strict=True):
                outputs[index] = value.float().cpu()
            return output.new_zeros(()), {}

        for micro_batches in steps:
            self._run_schedule(micro_batches, keep, forward_only=True)
        for chunk in self.model:
            chunk.train()
        if self.mpu.get_pipeline_model_parallel_world_size() > 1:
            holder = [outputs]
            last = self.mpu.get_pipeline_model_parallel_last_rank()
            dist.broadcast_object_list(holder, src=last, group=self.mpu.get_pipeline_model_parallel_group())
            outputs = holder[0]
        return outputs

    # ---- training ------------------------------------------------------------------------------
    def _step_gradients(
        self,
        micro_batches: list[PackedMicroBatch],
        data: dict,
        loss_function: Callable,
        normalizer: StepNormalizer,
        fill: bool,
    ) -> dict[str, float]:
        # Each data-parallel shard's metrics are counted once: on its last pipeline stage, TP/CP rank 0.
        reports = (
            self.mpu.is_pipeline_last_stage(ignore_virtual=True)
            and self.mpu.get_tensor_model_parallel_rank() == 0
            and self.mpu.get_context_parallel_rank() == 0
        )
        sums: dict[str, float] = defaultdict(float)
        scale = len(micro_batches) * self.dp_size

        def loss_of_output(micro_batch, output):
            outputs = self._training_outputs(micro_batch, output)
            loss, loss_metrics = loss_function(self.args, self._batch_inputs(micro_batch, data), outputs, normalizer)
            if reports:
                for name, value in loss_metrics.items():
                    sums[name] += float(value)
                if micro_batch.mtp_loss is not None:  # the mean over the step's micro-batches and ranks
                    sums["mtp_loss"] += micro_batch.mtp_loss / scale
            return loss * scale, {}

        if self.mtp_depth:
            for micro_batch in micro_batches:
                masks = [torch.as_tensor(data["loss_masks"][i]) for i in micro_batch.sample_indices]
                micro_batch.response_loss_mask = torch.cat(masks).to(micro_batch.target_tokens.device)

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run_schedule(micro_batches, loss_of_output, forward_only=False)
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads(self.model)
        return sums

    def _optimizer_step(self) -> float:
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float("nan") if found_inf else float(self.optimizer.get_grad_norm())
        if math.isfinite(grad_norm):
            if self.args.clip_grad and self.args.clip_grad > 0:
                self.optimizer.clip_grad_norm(self.args.clip_grad)
            self.optimizer.step_with_ready_grads()
            self.lr_scheduler.step(increment=1)
        return grad_norm

    def _stop_on_non_finite_grad(self) -> bool:
        # A skipped step is routine here: the fp16 loss scaler finds inf gradients while it calibrates.
        return False

    # ---- checkpoints and weight export ---------------------------------------------------------
    def _save_checkpoint(self, root: str, rollout_id: int, update_tracker: bool) -> None:
        optimizer = None if self.args.no_save_optim else self.optimizer
        adapter = dict(self._adapter_tensors(None)) if self.lora else None  # a collective; whole on rank 0
        checkpoint.save_checkpoint(
            root,
            rollout_id,
            self.model,
            optimizer,
            self.lr_scheduler,
            update_tracker=update_tracker,
            adapter_config=self._adapter_config(),
            adapter_tensors=adapter,
        )

    def _save_hf(self, path: str) -> None:
        checkpoint.save_hf_checkpoint(self.model, path, self.args.hf_checkpoint, family=self.family)

    def _model_weight_buckets(self, dtype: torch.dtype | None) -> Iterator[Bucket]:
        # With pipeline parallelism the stages forward their buckets (update_weight.py): to every rank
        # when colocated (any rank may serve an engine), else only to rank 0, the one sender.
        return hf_weight_buckets(
            self.model,
            self.family,
            self.vocab_size,
            self.args.update_weight_buffer_size,
            dtype,
            to_every_rank=self.weight_updater.every_rank_sends,
            include_mtp=self._engines_take_mtp,
        )

    # ---- LoRA (--lora-rank; what it changes is TrainRayActor's) ----------------------------------
    def _adapter_config(self) -> dict | None:
        return self.lora_config if self.lora else None

    def _adapter_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        # Gathered over TP; with pipeline parallelism the stages forward theirs to the pipeline group of rank 0.
        buckets = adapter_buckets(self.model, self.args.update_weight_buffer_size, dtype, to_every_rank=False)
        return (item for bucket in buckets for item in bucket)

    def _adapters_disabled(self) -> contextlib.AbstractContextManager:
        return lora.disable_adapters(self.model)

    # ---- offload -------------------------------------------------------------------------------
    def offload(self) -> int:
        """Free weights, gradients and optimizer state while the engines generate (`storage_offload`):
        their storages are released (bytes kept on pinned host memory on GPU, in a temp file on CPU) and
        `onload` restores them bit for bit; gradients come back as zeros. Sizes are in `self.offloaded`.

        Returns:
            Bytes released (0 when already offloaded).
        """
        if self.offloaded:
            return 0
        with torch.no_grad():
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
        # Weights first: with fp32 params the optimizer's params are the weights, released once (a released
        # storage has size 0 and is skipped).
        weights = release_storages(self._offload_weight_tensors())
        optimizer = release_storages(self._offload_optimizer_tensors())
        grads = release_storages(self._offload_grad_tensors(), keep_contents=False)
        self.offloaded = {"weights": weights, "optimizer": optimizer, "grads": grads}
        release_free_host_memory()
        if cuda_available():
            torch.cuda.empty_cache()
        sizes = ", ".join(f"{part} {released.nbytes / 2**20:.1f} MiB" for part, released in self.offloaded.items())
        logger.info("rank %d: offloaded the %s: %s", self.rank, self.role, sizes)
        return sum(released.nbytes for released in self.offloaded.values())

    def onload(self) -> None:
        """Undo `offload`: weights and optimizer state back bit for bit, gradients zero."""
        for released in self.offloaded.values():
            restore_storages(released)
        self.offloaded = {}

    @contextlib.contextmanager
    def _weights_onloaded(self) -> Iterator[None]:
        # The driver pushes weights (and may probe the engines) while offloaded: bring back only the weights
        # meanwhile; optimizer state and gradients stay released.
        weights = self.offloaded.pop("weights", None)
        if weights is None:
            yield
            return
        restore_storages(weights)
        try:
            yield
        finally:
            self.offloaded["weights"] = release_storages(self._offload_weight_tensors())
            release_free_host_memory()
            if cuda_available():
                torch.cuda.empty_cache()

    def update_weights(self) -> None:
        with self._weights_onloaded():
            super().update_weights()

    def check_weights_equal(self) -> dict[str, float]:
        with self._weights_onloaded():
            return super().check_weights_equal()

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's HF-named weights `update_weights` sends, on CPU, on every rank (a collective)."""
        with self._weights_onloaded():
            buckets = hf_weight_buckets(
                self.model,
                self.family,
                self.vocab_size,
                self.args.update_weight_buffer_size,
                include_mtp=self._engines_take_mtp,
            )
            # Copies: a bucket may view a parameter, whose storage is released again when offloaded.
            return {name: tensor.to("cpu", copy=True) for bucket in buckets for name, tensor in bucket}

    def _offload_weight_tensors(self) -> list[torch.Tensor]:
        # DDP's contiguous param buffers (distributed optimizer) back the params; any param outside them too.
        tensors = [buffer.param_data for chunk in self.model for buffer in _ddp_buffers(chunk)]
        return [t for t in tensors if t is not None] + [p.data for chunk in self.model for p in chunk.parameters()]

    def _offload_optimizer_tensors(self) -> list[torch.Tensor]:
        # The inner torch optimizers hold the fp32 main params (the model's own when training in fp32)
        # and Adam's exp_avg / exp_avg_sq.
        tensors = []
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(optimizer, "optimizer", None)
            if inner is None:
                continue
            tensors += [param.data for group in inner.param_groups for param in group["params"]]
            tensors += [value for state in inner.state.values() for value in state.values() if torch.is_tensor(value)]
        return tensors

    def _offload_grad_tensors(self) -> list[torch.Tensor]:
        tensors = [buffer.grad_data for chunk in self.model for buffer in _ddp_buffers(chunk)]
        for chunk in self.model:
            for param in chunk.parameters():
                tensors += [t for t in (getattr(param, "main_grad", None), param.grad) if t is not None]
        return [t for t in tensors if t is not None]


def _ddp_buffers(chunk) -> list:
    return [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]
