"""FSDP training rank: a HuggingFace model sharded with FSDP2, trained on rollout data, synced to engines.

The driver protocol and the per-rollout recipe are the backend-neutral `TrainRayActor`'s
(slime/backends/train_actor.py); this file builds the model and supplies its forward, optimizer
step, weight copies, HF export, checkpoints and offload.

Log-prob passes use the same packed micro-batches as training, so at the first optimizer step the
recomputed old log-probs, the reference log-probs (when reference == actor) and the training
forward agree bit for bit (`ppo_kl` and the KL loss are exactly 0); `--log-probs-max-tokens-per-gpu`
is therefore not used. With one optimizer step per rollout the old log-probs come from the training
forward itself when nothing reads them earlier (`fuses_old_log_probs`): one forward pass less.
"""

from __future__ import annotations

import contextlib
import logging
import math
from argparse import Namespace
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime.algorithms.aggregation import StepNormalizer
from slime.backends.fsdp_utils import checkpoint, lora
from slime.backends.fsdp_utils.data_packing import PackedMicroBatch, build_step_micro_batches, sliding_window_of
from slime.backends.fsdp_utils.loss import LOSS_FUNCTIONS
from slime.backends.fsdp_utils.model import (
    build_lr_scheduler,
    build_optimizer,
    freeze_vision_tower,
    is_hf_folder,
    load_local_shards,
    load_model,
    read_hf_state_dict,
    response_logits,
    response_values,
    select_trainable_parameters,
    shard_full_state_dict,
    shard_model,
    snapshot_local_shards,
    training_device,
    use_float32_attention,
    vision_batching,
)
from slime.backends.fsdp_utils.update_weight import full_parameter_buckets
from slime.backends.train_actor import TrainRayActor, Weights
from slime.utils.arguments import FSDP_ATTENTION_BACKENDS
from slime.utils.device import cuda_available
from slime.utils.micro_batches import split_per_sample
from slime.utils.misc import release_free_host_memory
from slime.utils.moe_routing import HFRouters
from slime.utils.perf import cpu_has_bf16_matmul
from slime.utils.ppo_utils import compute_log_probs
from slime.utils.processing_utils import is_vision_language
from slime.utils.weight_sync import Bucket

logger = logging.getLogger(__name__)

Steps = list[list[PackedMicroBatch]]


class FSDPTrainRayActor(TrainRayActor):
    """One FSDP training rank (actor or critic); see slime/backends/train_actor.py for the driver protocol."""

    loss_functions = LOSS_FUNCTIONS
    # The training forward runs over the same micro-batches as a separate no-grad pass, so its detached
    # log-probs are bit-identical to that pass's: `FusedForwardLogProbs` may take them.
    fuses_old_log_probs = True

    # ---- setup ---------------------------------------------------------------------------------
    def _build(self, args: Namespace, with_ref: bool) -> int:
        """Load, shard and (re)load the model; return the rollout id to start from (see `TrainRayActor.init`)."""
        torch.manual_seed(args.seed)
        self.device = training_device()
        self.dp_size = dist.get_world_size()
        if args.bf16 and not cuda_available() and not cpu_has_bf16_matmul():
            logger.warning("--bf16 on a CPU without bf16 units (AMX, AVX512-BF16): its bf16 matmuls are far slower")

        start_path = args.load if is_hf_folder(args.load) else args.hf_checkpoint
        # Megatron's --recompute-* and --attention-backend mean the same here (arguments.add_fsdp_megatron_arguments).
        recompute = args.recompute_activations or args.recompute_granularity
        attention = FSDP_ATTENTION_BACKENDS[args.attention_backend]
        model = load_model(
            start_path,
            self.role,
            gradient_checkpointing=bool(args.gradient_checkpointing or recompute),
            attn_implementation=attention,
            trust_remote_code=args.trust_remote_code,
        )
        # --bf16 on CPU: every forward runs under bf16 autocast (model.use_float32_attention)
        self.cpu_bf16 = args.bf16 and self.device.type == "cpu"
        if self.cpu_bf16:
            use_float32_attention(model)
        self.attn_implementation = model.config._attn_implementation
        self.sliding_window = sliding_window_of(model.config)
        if self.lora:  # --lora-rank: an adapter on the frozen base (the reference is the base: TrainRayActor)
            model = lora.apply_lora(model, args)
        # the probe of `check_weights_equal` (actor only: the critic's ValueModel has no LM embeddings API)
        self.vocab_size = None if self.value_head else model.get_input_embeddings().weight.shape[0]
        # --freeze-indexer: a DSA model's lightning indexer (`self_attn.indexer.*`) keeps the checkpoint's weights
        freeze = (args.freeze_params_name_list or []) + ([r"\.indexer\."] if args.freeze_indexer else [])
        if args.only_train_params_name_list or freeze:
            trainable = select_trainable_parameters(model, args.only_train_params_name_list, freeze)
            logger.info("rank %d: training %d of the model's parameter tensors", self.rank, len(trainable))
        if is_vision_language(model.config) and not args.train_vision_tower:  # the language model trains alone
            freeze_vision_tower(model)
        # --use-rollout-routing-replay: the actor's MoE routers take the engines' experts (`_response_logits`)
        self.routers = HFRouters(model, model.config.num_hidden_layers) if self.replay_routing else None
        self.model, _ = shard_model(model, self.dp_size, bf16=args.bf16)
        self.optimizer = build_optimizer(args, self.model)
        self.lr_scheduler = build_lr_scheduler(args, self.optimizer)
        # --multi-lora-n-adapters: each adapter has its own optimizer and scheduler; `train` takes each in turn.
        self.adapters = lora.peft_adapter_names(args) if self.lora else []
        self.adapter_optimizers = (
            lora.adapter_optimizers(args, self.model, self.adapters) if len(self.adapters) > 1 else []
        )
        if self.adapter_optimizers:
            self.optimizer, self.lr_scheduler = self.adapter_optimizers[0]
        self.ref_weights = self._reference_shards() if with_ref else None
        # What `_step_gradients` computes the loss from: the critic's values or the policy's logits.
        self._training_output = self._values_output if self.value_head else self._policy_output

        start_rollout_id = 0
        load_root = self._checkpoint_root(args.load)
        ckpt_step = args.ckpt_step  # Megatron's --ckpt-step: this step instead of the latest
        if load_root and (ckpt_step is not None or checkpoint.latest_iteration(load_root) is not None):
            finetune = args.finetune
            optimizer, scheduler = self._checkpointed_optimizers()
            loaded = checkpoint.load_checkpoint(
                load_root,
                self.model,
                None if finetune or args.no_load_optim else optimizer,
                None if finetune else scheduler,
                load_rng=not (finetune or args.no_load_rng),
                rollout_id=ckpt_step,
                adapter_only=self.lora,
            )
            start_rollout_id = 0 if finetune else loaded + 1
            logger.info("rank %d: loaded %s rollout %d", self.rank, load_root, loaded)
        elif args.load and not is_hf_folder(args.load):
            logger.info("--load %s holds no checkpoint yet; starting from %s", args.load, start_path)
        return start_rollout_id

    def _reference_shards(self) -> Weights:
        """CPU copy of this rank's reference-weight shards: `--ref-load` (HF folder or FSDP checkpoint),
        else the weights the actor starts from (before any resume)."""
        ref_load = self.args.ref_load
        if not ref_load:
            return snapshot_local_shards(self.model)
        if is_hf_folder(ref_load):
            return shard_full_state_dict(self.model, read_hf_state_dict(ref_load, "actor"))
        return checkpoint.read_checkpoint_shards(ref_load, self.model, self.args.ref_ckpt_step)

    def _snapshot_weights(self, into: Weights | None = None) -> Weights:
        return snapshot_local_shards(self.model, into=into)

    def _load_weights(self, weights: Weights) -> None:
        load_local_shards(self.model, weights)

    # ---- micro-batches and forward-only passes -------------------------------------------------
    def _micro_batches(self, data: dict) -> Steps:
        dynamic = self.args.use_dynamic_batch_size
        return build_step_micro_batches(
            data["tokens"],
            data["response_lengths"],
            data["num_steps"],
            micro_batch_size=self.args.micro_batch_size,
            max_tokens=self.args.max_tokens_per_gpu if dynamic else None,
            device=self.device,
            attn_implementation=self.attn_implementation,
            routed_experts=data.get("rollout_routed_experts") if self.routers is not None else None,
            vision=vision_batching(self.model, data.get("multimodal_train_inputs"), len(data["tokens"])),
            sliding_window=self.sliding_window,
            one_sample_rows=self.args.true_on_policy_mode,
        )

    def _probe_micro_batches(self, probe: list[int]) -> Steps:
        return build_step_micro_batches(
            [probe],
            [len(probe) - 1],
            1,
            1,
            None,
            device=self.device,
            attn_implementation=self.attn_implementation,
            vision=vision_batching(self.model, None, 1),
            sliding_window=self.sliding_window,
            one_sample_rows=self.args.true_on_policy_mode,
        )

    def _forward_log_probs(self, steps: Steps, num_samples: int, temperature: float | None = None) -> list:
        temperature = temperature or self.args.rollout_temperature

        def log_probs(micro_batch: PackedMicroBatch) -> torch.Tensor:
            return compute_log_probs(self._response_logits(micro_batch, temperature), micro_batch.target_tokens)

        return self._forward_per_sample(steps, num_samples, log_probs)

    def _forward_values(self, steps: Steps, num_samples: int) -> list:
        return self._forward_per_sample(steps, num_samples, self._values_output)

    def _policy_output(self, micro_batch: PackedMicroBatch) -> torch.Tensor:
        return self._response_logits(micro_batch, self.args.rollout_temperature)

    def _values_output(self, micro_batch: PackedMicroBatch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cpu_bf16):
            return response_values(self.model, micro_batch)

    def _response_logits(self, micro_batch: PackedMicroBatch, temperature: float) -> torch.Tensor:
        """`response_logits`, the routers replaying the micro-batch's routing when `replay_routing` is on.

        The routing stays set after the forward: gradient checkpointing reruns the routers in the backward.
        """
        if self.routers is not None:
            routing = micro_batch.routed_experts if self.replay_routing else None
            self.routers.replay = None if routing is None else routing.flatten(0, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cpu_bf16):
            return response_logits(self.model, micro_batch, temperature)

    @torch.no_grad()
    def _forward_per_sample(
        self, steps: Steps, num_samples: int, per_token: Callable[[PackedMicroBatch], torch.Tensor]
    ) -> list:
        """`per_token(micro_batch)` (`[M]` over the response tokens) split per sample, on CPU."""
        self.model.eval()
        outputs: list = [None] * num_samples
        for micro_batch in (mb for step in steps for mb in step):
            flat = per_token(micro_batch)
            if micro_batch.weight:
                for index, value in zip(
                    micro_batch.sample_indices, split_per_sample(flat, micro_batch.response_lengths)
                ):
                    outputs[index] = value.float().cpu()
        self.model.train()
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
        sums: dict[str, float] = defaultdict(float)
        for micro_batch in micro_batches:
            batch = self._batch_inputs(micro_batch, data)
            output = self._training_output(micro_batch)
            if fill:
                with torch.no_grad():
                    flat = compute_log_probs(output, micro_batch.target_tokens)
                batch["log_probs"] = split_per_sample(flat, micro_batch.response_lengths)
                if micro_batch.weight:
                    for index, log_probs in zip(micro_batch.sample_indices, batch["log_probs"]):
                        data["log_probs"][index] = log_probs.float().cpu()
            loss, loss_metrics = loss_function(self.args, batch, output, normalizer)
            # FSDP averages gradients over ranks; the loss is this rank's share of the global sum.
            (loss * (micro_batch.weight * self.dp_size)).backward()
            for name, value in loss_metrics.items():
                sums[name] += float(value) * micro_batch.weight
        return sums

    def _optimizer_step(self) -> float:
        max_norm = self.args.clip_grad if self.args.clip_grad and self.args.clip_grad > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _reset_optimizer_states(self) -> None:
        # Zeroed moments and step count: the next step is a fresh AdamW's first step.
        with torch.no_grad():
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()

    # ---- checkpoints and weight export ---------------------------------------------------------
    def _save_checkpoint(self, root: str, rollout_id: int, update_tracker: bool) -> None:
        checkpoint.save_checkpoint(
            root,
            rollout_id,
            self.model,
            *self._checkpointed_optimizers(),
            save_optimizer=not self.args.no_save_optim,
            role=self.role,
            update_tracker=update_tracker,
            adapter_only=self.lora,
        )

    def _save_hf(self, path: str) -> None:
        checkpoint.save_hf_checkpoint(self.model, path, self.args.hf_checkpoint, self.args.trust_remote_code)

    def _model_weight_buckets(self, dtype: torch.dtype | None) -> Iterator[Bucket]:
        return full_parameter_buckets(self.model, self.args.update_weight_buffer_size, dtype)

    # ---- LoRA (--lora-rank; what it changes is TrainRayActor's) ----------------------------------
    def train(self, rollout_id: int, rollout_data, values_refs=None) -> dict[str, float]:
        if self.adapter_optimizers:  # --multi-lora-n-adapters: each adapter on its own samples, with its optimizer
            return lora.train_each_adapter(self, rollout_id, rollout_data, super().train)
        return super().train(rollout_id, rollout_data, values_refs)

    def _checkpointed_optimizers(self) -> tuple:
        """(optimizer, LR scheduler) a checkpoint holds: a list of each under --multi-lora-n-adapters."""
        if not self.adapter_optimizers:
            return self.optimizer, self.lr_scheduler
        return [pair[0] for pair in self.adapter_optimizers], [pair[1] for pair in self.adapter_optimizers]

    def _adapter_config(self) -> dict | None:
        return lora.adapter_config(self.model) if self.lora else None

    def _adapter_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        return lora.adapter_tensors(self.model, dtype)

    def _adapters_disabled(self) -> contextlib.AbstractContextManager:
        return lora.adapters_disabled(self.model)

    # ---- offload -------------------------------------------------------------------------------
    def offload(self) -> int:
        """Free training memory while the engines generate: drop gradients; on GPU also move weights
        and optimizer state to CPU and release the CUDA cache. On CPU nothing else can be freed.

        Returns:
            Bytes freed on the training device (each storage once).
        """
        freed = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in _gradients(self.model)}
        if cuda_available():
            for tensor in [*self.model.parameters(), *_optimizer_tensors(self.optimizer)]:
                freed[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        self.optimizer.zero_grad(set_to_none=True)
        if cuda_available():
            self.model.to("cpu")
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
            torch.cuda.empty_cache()
        release_free_host_memory()
        return sum(freed.values())

    def onload(self) -> None:
        """Undo `offload`: weights and optimizer state back on the training device."""
        if cuda_available():
            self.model.to(self.device)
            _move_optimizer_state(self.optimizer, self.device)


def _gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
