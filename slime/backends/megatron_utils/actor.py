"""Megatron training rank: a megatron-core GPTModel (TP/PP/CP/EP, DDP, distributed optimizer) trained on
rollout data and synced to the engines under HuggingFace names; or, with role "critic", PPO's value model.

Driver protocol: the same as the FSDP actor's (see slime/backends/fsdp_utils/actor.py):
`init` -> `connect_rollout_engines` -> `update_weights`, then per rollout `train`, `save_model` at
`--save-interval`, `sleep`/`wake_up` around generation, `check_weights_equal` on demand. The critic
(`init(args, "critic")`) has no engines: per rollout `compute_values` (whose refs the actor's `train`
takes as `values_refs`) then `train`, and `save_model` to `<save>/critic`.

Per rollout, in Megatron's `train_actor` order: reference log-probs (the reference weights are
copied into the one model and back, as upstream's tensor backuper does: no second model), old
log-probs with the current weights (skipped with `--use-rollout-logprobs`), advantages and returns,
the `--rollout-data-postprocess-path` hook, then `num_steps` optimizer steps. Every pass runs the
same packed micro-batches through Megatron's forward-backward schedule (pipeline parallel aware).

Data: the driver splits a rollout into one shard per data-parallel rank and `RayTrainGroup` gives
every rank of a model-parallel group (TP x PP x CP) the shard of its data-parallel rank
(`actor_group.data_parallel_rank`); data-parallel collectives run over Megatron's data-parallel group.

Critic: the same backbone, loaded from the same HF weights but for the LM head, with a zero-initialized
value head (critic.py) giving one value per position; a response token's value is the one at the
position predicting it, as in the FSDP critic. Its `train` takes the values of `compute_values` (or
recomputes them), computes returns by GAE with a zero reward-side KL, and minimizes the clipped value
loss (`slime.algorithms.losses.value_loss`) through the same schedule. Its metrics are not prefixed.

Loss scaling: the loss of a micro-batch is this data-parallel rank's share of the global-batch
value (`loss.StepNormalizer`). Megatron's schedule divides it by the micro-batch count (and
multiplies by the CP size) and DDP averages gradients over data x context ranks, so the trainer
multiplies by micro-batches x DP size: the gradient is then that of the global-batch loss, as in FSDP.

On a machine without CUDA, megatron-core runs through `cpu_compat.apply_cpu_patch` (gloo, fp32,
local layer spec): never load transformers models in this process there.
"""

from __future__ import annotations

import logging
import math
import os
import time
from argparse import Namespace
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import ray
import torch
import torch.distributed as dist

from slime.algorithms.advantages import compute_advantages_and_returns
from slime.algorithms.aggregation import StepNormalizer, count_step_samples_and_tokens
from slime.algorithms.losses import value_loss
from slime.algorithms.policy_losses import loss_kind
from slime.backends.megatron_utils import checkpoint
from slime.backends.megatron_utils.config import args_vocab_size, config_from_hf, model_family, use_transformer_engine
from slime.backends.megatron_utils.cp_utils import gather_zigzag, zigzag_positions, zigzag_slice
from slime.backends.megatron_utils.critic import load_backbone_from_hf
from slime.backends.megatron_utils.data import (
    PackedMicroBatch,
    build_step_micro_batches,
)
from slime.backends.megatron_utils.loss import LOSS_FUNCTIONS, ResponseOutputs, log_probs_and_entropy
from slime.backends.megatron_utils.model import (
    build_model,
    build_optimizer,
    initialize_model_parallel_from_args,
)
from slime.backends.megatron_utils.parallel import named_weights
from slime.backends.megatron_utils.unwrap import unwrap_model
from slime.backends.megatron_utils.update_weight import hf_weight_buckets
from slime.backends.train_actor import TrainRayActor
from slime.utils.micro_batches import split_per_sample
from slime.utils.misc import load_function, release_free_host_memory
from slime.utils.weight_sync import (
    EngineLinks,
    check_engines_match,
    connect_engines,
    probe_tokens,
    update_engine_weights,
)

logger = logging.getLogger(__name__)


def megatron_model_args(args: Namespace) -> Namespace:
    """slime's args plus the model flags: `MODEL_ARGS` when given (`--num-layers` set), else derived
    from the HF config of `--hf-checkpoint`.

    The copy also turns off Megatron's own per-token loss averaging and NaN-gradient error: slime
    normalizes the loss itself and skips non-finite steps, like the FSDP backend.
    """
    model_args = Namespace(**vars(args))
    if getattr(args, "num_layers", None) is None:
        if not getattr(args, "hf_checkpoint", None):
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

    decay_steps = getattr(args, "lr_decay_iters", None)
    if decay_steps is None and getattr(args, "num_rollout", None):
        decay_steps = args.num_rollout * args.num_steps_per_rollout
    decay_steps = max(int(decay_steps or 1), 1)
    warmup_fraction = getattr(args, "lr_warmup_fraction", None)
    warmup_steps = int(warmup_fraction * decay_steps) if warmup_fraction is not None else args.lr_warmup_iters
    if warmup_steps >= decay_steps and args.lr_decay_style != "constant":
        raise ValueError(
            f"--lr-warmup-iters {warmup_steps} must be below the decay length {decay_steps} "
            "(--lr-decay-iters, or --num-rollout x --num-steps-per-rollout)"
        )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=float(getattr(args, "lr_warmup_init", 0.0) or 0.0),
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
        wsd_decay_steps=getattr(args, "lr_wsd_decay_iters", None),
        lr_wsd_decay_style=getattr(args, "lr_wsd_decay_style", None),
    )


class MegatronTrainRayActor(TrainRayActor):
    """One Megatron training rank (role "actor" or "critic"); see the module docstring for the protocol."""

    # ---- setup ---------------------------------------------------------------------------------
    def init(self, args: Namespace, role: str, with_ref: bool = False) -> int:
        """Build model, optimizer and LR scheduler, load weights; return the rollout id to start from.

        Args:
            args: Parsed slime arguments (Megatron flags included).
            role: "actor", or "critic" (PPO's value model: HF backbone plus a zero-initialized value head).
            with_ref: Keep the reference weights on CPU for `--use-kl-loss` / `--kl-coef` (actor only).

        Returns:
            The torch_dist checkpoint's rollout id + 1 when resuming from `--load` (the critic's from
            `<load>/critic`), else 0.
        """
        if role not in ("actor", "critic"):
            raise ValueError(f"unknown role {role!r}; use 'actor' or 'critic'")
        with_ref = with_ref and role == "actor"
        if role == "actor" and (args.use_kl_loss or args.kl_coef != 0) and not with_ref:
            raise ValueError("--use-kl-loss / --kl-coef need reference log-probs: init the actor with with_ref=True")
        self.args, self.role = args, role
        self.init_process_group(args)
        if not torch.cuda.is_available():
            from slime.backends.megatron_utils.cpu_compat import apply_cpu_patch

            apply_cpu_patch()
        from megatron.core import parallel_state

        self.model_args = megatron_model_args(args)
        initialize_model_parallel_from_args(self.model_args)
        self.mpu = parallel_state
        self.family = model_family(self.model_args)
        self.vocab_size = args_vocab_size(self.model_args)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.device = self.device or torch.device("cpu")
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.use_packed_seq_params = use_transformer_engine(self.model_args)
        if self.cp_size > 1 and not self.use_packed_seq_params:
            raise ValueError("--context-parallel-size > 1 needs TransformerEngine attention (a GPU with TE)")

        self.model = build_model(self.model_args, role=role)
        for chunk in self.model:
            unwrap_model(chunk).config.variable_seq_lengths = True  # packed rows differ in length
        self.optimizer = build_optimizer(self.model_args, self.model)
        self.lr_scheduler = build_lr_scheduler(args, self.optimizer)

        start_hf = args.load if args.load and checkpoint.is_hf_checkpoint(args.load) else args.hf_checkpoint
        self.ref_weights: dict[str, torch.Tensor] | None = None
        if with_ref:
            ref_source = args.ref_load or start_hf
            checkpoint.load_checkpoint(ref_source, self.model, iteration=self._ref_iteration(ref_source))
            self.ref_weights = self._snapshot_weights()
        if role == "critic":
            load_backbone_from_hf(self.model, start_hf)  # the value head keeps its zeros
        elif not with_ref or args.ref_load:
            checkpoint.load_checkpoint(start_hf, self.model)
        self.optimizer.reload_model_params()  # fp32 main copies of 16-bit params follow the loaded weights

        start_rollout_id = 0
        load_root = self._checkpoint_root(args.load)
        if load_root and not checkpoint.is_hf_checkpoint(args.load) and checkpoint.has_checkpoint(load_root):
            finetune = bool(getattr(args, "finetune", False))
            load_optimizer = not finetune and not getattr(args, "no_load_optim", False)
            iteration, _ = checkpoint.load_checkpoint(
                load_root,
                self.model,
                self.optimizer if load_optimizer else None,
                None if finetune else self.lr_scheduler,
            )
            if not load_optimizer:
                self.optimizer.reload_model_params()
            start_rollout_id = 0 if finetune else iteration + 1
            logger.info("rank %d: resumed the %s from %s rollout %d", self.rank, role, load_root, iteration)

        self.actor_backup: dict[str, torch.Tensor] | None = None
        self.engine_links: EngineLinks | None = None
        self.weight_version = 0
        return start_rollout_id

    def _checkpoint_root(self, folder: str | None) -> str | None:
        """Where this role's torch_dist checkpoints live under `--save` / `--load` (the critic: `critic/`)."""
        if not folder:
            return None
        return folder if self.role == "actor" else os.path.join(folder, "critic")

    def _ref_iteration(self, source: str) -> int | None:
        if checkpoint.is_hf_checkpoint(source):
            return None
        return getattr(self.args, "ref_ckpt_step", None)

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{i}.{name}", tensor) for i, chunk in enumerate(self.model) for name, tensor in named_weights(chunk)]

    def _snapshot_weights(self, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """CPU copies of this rank's weights (reusing the tensors of `into`)."""
        with torch.no_grad():
            if into is None:
                return {name: t.detach().to("cpu", copy=True) for name, t in self._named_weights()}
            for name, tensor in self._named_weights():
                into[name].copy_(tensor)
        return into

    @torch.no_grad()
    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, tensor in self._named_weights():
            tensor.copy_(weights[name])

    # ---- data ----------------------------------------------------------------------------------
    def _prepare(self, rollout_data: Any) -> dict:
        """This data-parallel rank's samples, per-token fields as float tensors."""
        if isinstance(rollout_data, ray.ObjectRef):
            rollout_data = ray.get(rollout_data)
        data = dict(rollout_data)
        data.setdefault("num_steps", self.args.num_steps_per_rollout)
        data["loss_masks"] = [torch.as_tensor(mask, dtype=torch.float32) for mask in data["loss_masks"]]
        if data.get("rollout_log_probs") is not None:
            data["rollout_log_probs"] = [torch.as_tensor(lp, dtype=torch.float32) for lp in data["rollout_log_probs"]]
        data["total_lengths"] = [len(tokens) for tokens in data["tokens"]]
        return data

    def _micro_batches(self, data: dict) -> list[list[PackedMicroBatch]]:
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
        )

    def _batch_inputs(self, micro_batch: PackedMicroBatch, data: dict) -> dict:
        num_samples = len(data["tokens"])
        batch = {}
        for key, values in data.items():
            if isinstance(values, list) and len(values) == num_samples:
                picked = [values[i] for i in micro_batch.sample_indices]
                batch[key] = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in picked]
        batch["target_tokens"] = micro_batch.target_tokens
        batch["response_lengths"] = micro_batch.response_lengths
        return batch

    # ---- forward through Megatron's schedule -----------------------------------------------------
    def _model_forward(self, chunk, micro_batch: PackedMicroBatch) -> torch.Tensor:
        input_ids, position_ids = micro_batch.input_ids, micro_batch.position_ids
        if self.cp_size > 1:
            bounds = micro_batch.cu_seqlens.tolist()
            rank = self.mpu.get_context_parallel_rank()
            input_ids = zigzag_slice(input_ids, bounds, self.cp_size, rank)
            position_ids = zigzag_slice(position_ids, bounds, self.cp_size, rank)
        if self.use_packed_seq_params:
            return chunk(input_ids, position_ids, None, packed_seq_params=micro_batch.packed_seq_params())
        return chunk(input_ids, position_ids, micro_batch.attention_mask())

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

    def _forward_log_probs(
        self, steps: list[list[PackedMicroBatch]], num_samples: int, temperature: float | None = None
    ) -> list[torch.Tensor]:
        """Per-sample response log-probs on CPU (at the rollout temperature unless given), no gradient."""
        temperature = temperature or self.args.rollout_temperature

        def log_probs(micro_batch, logits):
            return self._response_outputs(micro_batch, logits, temperature, entropy_grad=False).log_probs

        return self._forward_per_sample(steps, num_samples, log_probs)

    def _forward_values(self, steps: list[list[PackedMicroBatch]], num_samples: int) -> list[torch.Tensor]:
        """Critic: per-sample values of the response tokens on CPU, no gradient."""
        return self._forward_per_sample(steps, num_samples, self._response_values)

    @torch.no_grad()
    def _forward_per_sample(
        self,
        steps: list[list[PackedMicroBatch]],
        num_samples: int,
        per_token: Callable[[PackedMicroBatch, torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
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

    def _reference_log_probs(self, steps: list[list[PackedMicroBatch]], num_samples: int) -> list[torch.Tensor]:
        """Swap the reference weights in, take log-probs, swap the actor weights back."""
        self.actor_backup = self._snapshot_weights(into=self.actor_backup)
        self._load_weights(self.ref_weights)
        try:
            return self._forward_log_probs(steps, num_samples)
        finally:
            self._load_weights(self.actor_backup)

    def compute_values(self, rollout_data: Any) -> list[list[float]]:
        """Critic: the value of every response token of this rank's samples (the actor's GAE input for PPO).

        The values are kept for this rollout's `train`, which needs the same ones as its "old" values.

        Args:
            rollout_data: This rank's shard (dict or ObjectRef).

        Returns:
            One list of floats per sample, in shard order: the value at the position predicting each
            response token. Equal on every rank of a model-parallel group.
        """
        if self.role != "critic":
            raise RuntimeError("compute_values is the critic's: init this rank with role 'critic'")
        data = self._prepare(rollout_data)
        values = self._forward_values(self._micro_batches(data), len(data["tokens"]))
        self._remember_values(data, values)
        return [value.tolist() for value in values]

    # ---- training ------------------------------------------------------------------------------
    def train(self, rollout_id: int, rollout_data: Any, values_refs: Any = None) -> dict[str, float]:
        """Train on this rank's shard of one rollout (same contract as the FSDP actor and critic).

        Args:
            rollout_id: The rollout's id (for hooks and logs).
            rollout_data: This rank's shard (dict or ObjectRef).
            values_refs: Actor under PPO: the critic's values (every rank's `compute_values` refs, or this
                rank's values). The critic uses its own `compute_values` of this shard (or recomputes them).

        Returns:
            Metrics averaged over the rollout's optimizer steps, equal on every rank: the actor's named
            `train/<name>`, the critic's `<name>` (value_loss, value_clipfrac, grad_norm, lr, ...).
        """
        data = self._prepare(rollout_data)
        steps = self._micro_batches(data)
        num_samples = len(data["tokens"])
        metrics: dict[str, float] = {}
        if self.role == "critic":
            data["values"] = self._take_remembered_values(data)
            if data["values"] is None:
                data["values"] = self._forward_values(steps, num_samples)
        else:
            self._check_rollout_log_probs(data)
            if self.ref_weights is not None:
                data["ref_log_probs"] = self._reference_log_probs(steps, num_samples)
            if self.args.use_rollout_logprobs:
                data["log_probs"] = data["rollout_log_probs"]
            elif not self._old_log_probs_unused(has_reference=self.ref_weights is not None):
                data["log_probs"] = self._forward_log_probs(steps, num_samples)
                if data.get("rollout_log_probs") is not None:
                    metrics["train_rollout_logprob_abs_diff"], metrics["train_rollout_logprob_max_abs_diff"] = (
                        self._logprob_abs_diff(data["log_probs"], data["rollout_log_probs"], data["loss_masks"])
                    )
            if values_refs is not None:
                data["values"] = self._values_for_this_rank(values_refs)
        if not self.args.disable_compute_advantages_and_returns:
            compute_advantages_and_returns(
                self.args, data, self.mpu.get_data_parallel_group(), self._collective_device()
            )
        if self.args.rollout_data_postprocess_path:
            load_function(self.args.rollout_data_postprocess_path)(self.args, rollout_id, data)
        metrics |= self._optimize(rollout_id, steps, data)
        prefix = "train/" if self.role == "actor" else ""
        return {f"{prefix}{name}": value for name, value in metrics.items()}

    def _step_normalizers(self, steps: list[list[PackedMicroBatch]], data: dict) -> list[StepNormalizer]:
        """Sample and trainable-token counts of each step over the data-parallel group."""
        step_indices = [[i for mb in micro_batches for i in mb.sample_indices] for micro_batches in steps]
        counts = count_step_samples_and_tokens(step_indices, data["loss_masks"])
        counts = self._all_reduce(counts, self.mpu.get_data_parallel_group())
        return [StepNormalizer.from_args(self.args, samples, tokens) for samples, tokens in counts.tolist()]

    def _optimize(self, rollout_id: int, steps: list[list[PackedMicroBatch]], data: dict) -> dict[str, float]:
        """One optimizer step per entry of `steps`; metrics averaged over steps, reduced over ranks."""
        normalizers = self._step_normalizers(steps, data)
        loss_function = value_loss if self.role == "critic" else LOSS_FUNCTIONS[loss_kind(self.args.loss_type)]
        temperature = self.args.rollout_temperature
        entropy_grad = self.args.entropy_coef != 0
        # Each data-parallel shard's metrics are counted once: on its last pipeline stage, TP/CP rank 0.
        reports = (
            self.mpu.is_pipeline_last_stage(ignore_virtual=True)
            and self.mpu.get_tensor_model_parallel_rank() == 0
            and self.mpu.get_context_parallel_rank() == 0
        )
        hook = getattr(self.args, "custom_megatron_before_train_step_hook_path", None)
        started = time.time()
        step_sums: list[dict[str, float]] = []
        grad_norms, lrs, skipped = [], [], 0
        for step_id, (micro_batches, normalizer) in enumerate(zip(steps, normalizers, strict=True)):
            if hook:
                load_function(hook)(self.args, rollout_id, step_id, self.model, self.optimizer, self.lr_scheduler)
            sums: dict[str, float] = defaultdict(float)
            scale = len(micro_batches) * self.dp_size

            def loss_of_output(micro_batch, output, normalizer=normalizer, sums=sums, scale=scale):
                if self.role == "critic":
                    outputs = self._response_values(micro_batch, output)
                else:
                    outputs = self._response_outputs(micro_batch, output, temperature, entropy_grad)
                loss, loss_metrics = loss_function(
                    self.args, self._batch_inputs(micro_batch, data), outputs, normalizer
                )
                if reports:
                    for name, value in loss_metrics.items():
                        sums[name] += float(value)
                return loss * scale, {}

            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            self._run_schedule(micro_batches, loss_of_output, forward_only=False)
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads(self.model)
            lrs.append(self.optimizer.param_groups[0]["lr"])
            grad_norm = self._step_optimizer()
            if math.isfinite(grad_norm):
                self.lr_scheduler.step(increment=1)
                grad_norms.append(grad_norm)
            else:
                skipped += 1
                logger.warning("rank %d: grad norm is %s; skipping this optimizer step", self.rank, grad_norm)
            step_sums.append(sums)
        elapsed = time.time() - started

        names = sorted({name for sums in step_sums for name in sums})
        all_names: list = [None] * dist.get_world_size()
        dist.all_gather_object(all_names, names)
        names = sorted({name for group in all_names for name in group})
        totals = torch.tensor([[sums.get(name, 0.0) for name in names] for sums in step_sums], dtype=torch.float64)
        totals = self._all_reduce(totals).mean(dim=0).tolist() if names else []
        metrics = dict(zip(names, totals, strict=True))
        tokens = self._all_reduce(
            torch.tensor([float(sum(data["total_lengths"]))], dtype=torch.float64), self.mpu.get_data_parallel_group()
        ).item()
        metrics |= {
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "lr": sum(lrs) / len(lrs),
            "skipped_steps": float(skipped),
            "step_time": elapsed / len(steps),
            "tokens_per_s": tokens / max(elapsed, 1e-9),
        }
        return metrics

    def _step_optimizer(self) -> float:
        """Gradient norm over all ranks; clip to `--clip-grad` and step unless it is not finite."""
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float("nan") if found_inf else float(self.optimizer.get_grad_norm())
        if math.isfinite(grad_norm):
            if self.args.clip_grad and self.args.clip_grad > 0:
                self.optimizer.clip_grad_norm(self.args.clip_grad)
            self.optimizer.step_with_ready_grads()
        return grad_norm

    def _logprob_abs_diff(
        self, a: list[torch.Tensor], b: list[torch.Tensor], masks: list[torch.Tensor]
    ) -> tuple[float, float]:
        """Mean and max of |a - b| over trainable tokens of the data-parallel group (trainer vs engine)."""
        totals = torch.zeros(3, dtype=torch.float64)
        for x, y, mask in zip(a, b, masks, strict=True):
            diff = (torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)).abs() * mask
            totals[0] += float(diff.sum())
            totals[1] += float(mask.sum())
            totals[2] = max(float(totals[2]), float(diff.max()) if diff.numel() else 0.0)
        group = self.mpu.get_data_parallel_group()
        summed = self._all_reduce(totals[:2].clone(), group)
        largest = totals[2:].to(self._collective_device())
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        return float(summed[0] / summed[1].clamp_min(1)), float(largest.cpu())

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Sum over `group` (default: all ranks); returns a CPU tensor."""
        reduced = tensor.to(self._collective_device())
        dist.all_reduce(reduced, group=group)
        return reduced.cpu()

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_model(self, rollout_id: int, update_tracker: bool = True) -> None:
        """torch_dist checkpoint to `--save` (the critic's to `<save>/critic`; atomic, resumable) and, for the
        actor, an HF export to `--save-hf`. `update_tracker=False`: the driver names the step in the tracker
        once every part of it is written."""
        root = self._checkpoint_root(self.args.save)
        if root:
            checkpoint.save_checkpoint(
                root,
                rollout_id,
                self.model,
                None if getattr(self.args, "no_save_optim", False) else self.optimizer,
                self.lr_scheduler,
                update_tracker=update_tracker,
            )
        if self.role == "actor" and getattr(self.args, "save_hf", None):
            path = self.args.save_hf.format(rollout_id=rollout_id)
            checkpoint.save_hf_checkpoint(self.model, path, self.args.hf_checkpoint, family=self.family)

    # ---- weight sync ---------------------------------------------------------------------------
    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's HF-named weights `update_weights` sends, on CPU, on every rank (a collective)."""
        buckets = hf_weight_buckets(self.model, self.family, self.vocab_size, self.args.update_weight_buffer_size)
        return {name: tensor.cpu() for bucket in buckets for name, tensor in bucket}

    def connect_rollout_engines(self, engines: list, engine_urls: list[str]) -> None:
        """Remember the engines; colocated: form span subgroups, disaggregated: rank 0 forms the broadcast group."""
        self.engine_links = connect_engines(self.args, engines, engine_urls, self.rank, dist.get_world_size())

    def update_weights(self) -> None:
        """Push the current weights to every engine (paused meanwhile) under the next weight version."""
        if self.role != "actor":
            raise RuntimeError("only the actor syncs weights to the engines; the critic's value head is not an LM")
        if self.engine_links is None or not self.engine_links.engines:
            raise RuntimeError("update_weights before connect_rollout_engines: the actor has no engines to update")
        dtype = torch.bfloat16 if getattr(self.args, "bf16", False) else None
        # With pipeline parallelism the stages forward their buckets (update_weight.py): to every rank
        # when colocated (any rank may serve an engine), else only to rank 0, the broadcast sender.
        buckets = hf_weight_buckets(
            self.model,
            self.family,
            self.vocab_size,
            self.args.update_weight_buffer_size,
            dtype,
            to_every_rank=self.engine_links.colocate,
        )
        update_engine_weights(self.engine_links, buckets, self.rank, str(self.weight_version + 1))
        self.weight_version += 1
        if self.args.check_weight_update_equal and self.weight_version == 1:
            self.check_weights_equal()

    def check_weights_equal(self) -> dict[str, float]:
        """Compare each engine's log-probs of a probe sequence with this trainer's (every rank must call).

        Returns:
            {"max_abs_diff": largest gap over engines and tokens} (rank 0; 0.0 elsewhere).

        Raises:
            RuntimeError: on rank 0 when the gap exceeds `weight_sync.WEIGHT_CHECK_TOLERANCE`.
        """
        probe = probe_tokens(self.vocab_size)
        steps = build_step_micro_batches([probe], [len(probe) - 1], 1, 1, None, self.tp_size, self.device)
        trainer = self._forward_log_probs(steps, 1, temperature=1.0)[0]
        if self.rank != 0:
            return {"max_abs_diff": 0.0}
        engines = self.engine_links.engines if self.engine_links else []
        gap = check_engines_match(engines, probe, trainer, self.weight_version)
        return {"max_abs_diff": gap}

    # ---- offload -------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free what can be freed while the engines generate: gradients (and the CUDA cache on GPU).

        Weights and optimizer state stay resident: Megatron's DDP keeps them in contiguous buffers
        that other tensors view, so moving them needs a memory saver (torch_memory_saver upstream).
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        release_free_host_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Undo `sleep` (nothing was moved)."""
