"""FSDP training rank: a HuggingFace model sharded with FSDP2, trained on rollout data, synced to engines.

Driver protocol (what `RayTrainGroup` / train.py call on every rank, in this order):

    start_rollout_id = init(args, role, with_ref)        role "actor" or "critic"; with_ref keeps a
                                                         reference copy for KL terms
    connect_rollout_engines(engines, engine_urls)        actor only, before the first update
    update_weights()                                     actor only; after init and after each train
    check_weights_equal() -> dict                        actor only, optional (--check-weight-update-equal
                                                         also runs it after the first update)
    per rollout:
      PPO: values = critic.compute_values(rollout_data)  per rank: list of per-sample value lists
           actor.train(rollout_id, rollout_data, values_refs=[every rank's compute_values ref])
                                                         skipped by the driver during --num-critic-only-steps
           critic.train(rollout_id, rollout_data)        may run concurrently with the actor
      else: actor.train(rollout_id, rollout_data)
      save_model(rollout_id)                             at --save-interval
      sleep() / wake_up()                                around generation when offloading

`rollout_data` is this rank's shard from `split_train_data_by_dp` (or a Ray ObjectRef to it).
`train` returns the rollout's metrics, identical on every rank: the actor's are named
`train/<name>`, the critic's plain `<name>` (the driver prefixes them).

Per rollout the actor follows Megatron's `train_actor` order: reference log-probs (the reference
weights are swapped into the one model and back: no second model), old log-probs with the current
weights (skipped with `--use-rollout-logprobs`; with one optimizer step per rollout they come from the
training forward itself when nothing reads them earlier: one forward pass less), advantages and
returns, the `--rollout-data-postprocess-path` hook, then `num_steps` optimizer steps.

Log-prob passes use the same packed micro-batches as training, so at the first optimizer step the
recomputed old log-probs, the reference log-probs (when reference == actor) and the training
forward agree bit for bit (`ppo_kl` and the KL loss are exactly 0); `--log-probs-max-tokens-per-gpu`
is therefore not used.

The critic computes its returns by GAE from its own values and the rewards with a zero reward-side
KL (exact unless `--kl-coef` is non-zero, where the actor's advantages include the KL penalty).
"""

from __future__ import annotations

import logging
import math
import os
import time
from argparse import Namespace
from collections import defaultdict
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slime.algorithms.advantages import compute_advantages_and_returns
from slime.algorithms.aggregation import StepNormalizer, count_step_samples_and_tokens
from slime.algorithms.losses import value_loss
from slime.algorithms.policy_losses import loss_kind
from slime.backends.fsdp_utils import checkpoint
from slime.backends.fsdp_utils.data_packing import PackedMicroBatch, build_step_micro_batches
from slime.backends.fsdp_utils.loss import LOSS_FUNCTIONS
from slime.backends.fsdp_utils.model import (
    build_lr_scheduler,
    build_optimizer,
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
)
from slime.backends.fsdp_utils.update_weight import full_parameter_buckets
from slime.backends.train_actor import TrainRayActor
from slime.utils.arguments import FSDP_ATTENTION_BACKENDS
from slime.utils.micro_batches import split_per_sample
from slime.utils.misc import load_function, release_free_host_memory
from slime.utils.ppo_utils import compute_log_probs
from slime.utils.weight_sync import (
    EngineLinks,
    check_engines_match,
    connect_engines,
    probe_tokens,
    update_engine_weights,
)

logger = logging.getLogger(__name__)


class FSDPTrainRayActor(TrainRayActor):
    """One FSDP training rank (actor or critic); see the module docstring for the driver protocol."""

    # ---- setup ---------------------------------------------------------------------------------
    def init(self, args: Namespace, role: str, with_ref: bool = False) -> int:
        """Build, shard and (re)load the model; return the rollout id to start from.

        Args:
            args: Parsed slime arguments.
            role: "actor" or "critic".
            with_ref: Keep reference weights for `--use-kl-loss` / `--kl-coef` (actor only).

        Returns:
            The checkpoint's rollout id + 1 when resuming from `--load`, else 0.
        """
        self.args, self.role = args, role
        self.init_process_group(args)
        torch.manual_seed(args.seed)
        self.device = training_device()
        self.dp_size = dist.get_world_size()
        self.metric_prefix = "train/" if role == "actor" else ""
        if role == "actor" and (args.use_kl_loss or args.kl_coef != 0) and not with_ref:
            raise ValueError("--use-kl-loss / --kl-coef need reference log-probs: init the actor with with_ref=True")
        if getattr(args, "bf16", False) and not torch.cuda.is_available():
            logger.warning("--bf16 on CPU: bf16 matmuls are far slower than float32 on CPUs without bf16 units")

        start_path = args.load if is_hf_folder(args.load) else args.hf_checkpoint
        # Megatron's --recompute-* and --attention-backend mean the same here (arguments.add_fsdp_megatron_arguments).
        recompute = getattr(args, "recompute_activations", False) or getattr(args, "recompute_granularity", None)
        attention = FSDP_ATTENTION_BACKENDS[getattr(args, "attention_backend", None) or "auto"]
        model = load_model(
            start_path,
            role,
            gradient_checkpointing=bool(getattr(args, "gradient_checkpointing", False) or recompute),
            attn_implementation=attention,
        )
        self.attn_implementation = model.config._attn_implementation
        if args.only_train_params_name_list or args.freeze_params_name_list:
            trainable = select_trainable_parameters(
                model, args.only_train_params_name_list, args.freeze_params_name_list
            )
            logger.info("rank %d: training %d of the model's parameter tensors", self.rank, len(trainable))
        self.model, _ = shard_model(model, self.dp_size, bf16=getattr(args, "bf16", False))
        self.optimizer = build_optimizer(args, self.model)
        self.lr_scheduler = build_lr_scheduler(args, self.optimizer)

        self.ref_shards = self._reference_shards() if role == "actor" and with_ref else None
        self.actor_backup: dict[str, torch.Tensor] | None = None
        self.engine_links: EngineLinks | None = None
        self.weight_version = 0
        # --keep-old-actor: weight version pushed to the engines -> CPU copy of this rank's shards then
        self.pushed_weights: dict[int, dict[str, torch.Tensor]] = {}

        start_rollout_id = 0
        load_root = self._checkpoint_root(args.load)
        ckpt_step = getattr(args, "ckpt_step", None)  # Megatron's --ckpt-step: this step instead of the latest
        if load_root and (ckpt_step is not None or checkpoint.latest_iteration(load_root) is not None):
            finetune = getattr(args, "finetune", False)
            loaded = checkpoint.load_checkpoint(
                load_root,
                self.model,
                None if finetune or getattr(args, "no_load_optim", False) else self.optimizer,
                None if finetune else self.lr_scheduler,
                load_rng=not (finetune or getattr(args, "no_load_rng", False)),
                rollout_id=ckpt_step,
            )
            start_rollout_id = 0 if finetune else loaded + 1
            logger.info("rank %d: loaded %s rollout %d", self.rank, load_root, loaded)
        elif args.load and not is_hf_folder(args.load):
            logger.info("--load %s holds no checkpoint yet; starting from %s", args.load, start_path)
        return start_rollout_id

    def _checkpoint_root(self, folder: str | None) -> str | None:
        """Where this role's checkpoints live under `--save` / `--load` (the critic uses a subfolder)."""
        if not folder:
            return None
        return folder if self.role == "actor" else os.path.join(folder, "critic")

    def _reference_shards(self) -> dict[str, torch.Tensor]:
        """CPU copy of this rank's reference-weight shards: `--ref-load` (HF folder or FSDP checkpoint),
        else the weights the actor starts from (before any resume)."""
        ref_load = self.args.ref_load
        if not ref_load:
            return snapshot_local_shards(self.model)
        if is_hf_folder(ref_load):
            return shard_full_state_dict(self.model, read_hf_state_dict(ref_load, "actor"))
        return checkpoint.read_checkpoint_shards(ref_load, self.model, getattr(self.args, "ref_ckpt_step", None))

    # ---- data ----------------------------------------------------------------------------------
    def _prepare(self, rollout_data: Any) -> dict:
        """This rank's shard as a dict with per-sample float tensors for the per-token fields."""
        if isinstance(rollout_data, ray.ObjectRef):
            rollout_data = ray.get(rollout_data)
        data = dict(rollout_data)
        data["loss_masks"] = [torch.as_tensor(mask, dtype=torch.float32) for mask in data["loss_masks"]]
        if data.get("rollout_log_probs") is not None:
            data["rollout_log_probs"] = [torch.as_tensor(lp, dtype=torch.float32) for lp in data["rollout_log_probs"]]
        data["total_lengths"] = [len(tokens) for tokens in data["tokens"]]
        data.setdefault("num_steps", self.args.num_steps_per_rollout)
        return data

    def _micro_batches(self, data: dict) -> list[list[PackedMicroBatch]]:
        dynamic = self.args.use_dynamic_batch_size
        return build_step_micro_batches(
            data["tokens"],
            data["response_lengths"],
            data["num_steps"],
            micro_batch_size=self.args.micro_batch_size,
            max_tokens=self.args.max_tokens_per_gpu if dynamic else None,
            device=self.device,
            attn_implementation=self.attn_implementation,
        )

    def _batch_inputs(self, micro_batch: PackedMicroBatch, data: dict) -> dict:
        """The micro-batch's slice of every per-sample field of `data`, tensors on the training device."""
        num_samples = len(data["tokens"])
        batch = {}
        for key, values in data.items():
            if isinstance(values, list) and len(values) == num_samples:
                picked = [values[i] for i in micro_batch.sample_indices]
                batch[key] = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in picked]
        batch["target_tokens"] = micro_batch.target_tokens
        batch["response_lengths"] = micro_batch.response_lengths
        return batch

    # ---- forward-only passes -------------------------------------------------------------------
    @torch.no_grad()
    def _forward_per_sample(
        self, steps: list[list[PackedMicroBatch]], num_samples: int, what: str, temperature: float | None = None
    ) -> list:
        """Per-sample log-probs (`what="log_probs"`, at `temperature`, default the rollout's) or critic
        values (`"values"`) on CPU, without gradient."""
        self.model.eval()
        outputs: list = [None] * num_samples
        for micro_batch in (mb for step in steps for mb in step):
            if what == "values":
                flat = response_values(self.model, micro_batch)
            else:
                logits = response_logits(self.model, micro_batch, temperature or self.args.rollout_temperature)
                flat = compute_log_probs(logits, micro_batch.target_tokens)
            if micro_batch.weight:
                for index, value in zip(
                    micro_batch.sample_indices, split_per_sample(flat, micro_batch.response_lengths)
                ):
                    outputs[index] = value.float().cpu()
        self.model.train()
        return outputs

    def _reference_log_probs(self, steps: list[list[PackedMicroBatch]], num_samples: int) -> list[torch.Tensor]:
        """Swap the reference weights into the model, take log-probs, swap the actor weights back."""
        return self._log_probs_with(self.ref_shards, steps, num_samples)

    def _log_probs_with(
        self, shards: dict[str, torch.Tensor], steps: list[list[PackedMicroBatch]], num_samples: int
    ) -> list[torch.Tensor]:
        """Log-probs of other weights (`shards`, this rank's part): swapped into the model and back."""
        self.actor_backup = snapshot_local_shards(self.model, into=self.actor_backup)
        load_local_shards(self.model, shards)
        try:
            return self._forward_per_sample(steps, num_samples, "log_probs")
        finally:
            load_local_shards(self.model, self.actor_backup)

    def _behaviour_shards(self, data: dict) -> dict[str, torch.Tensor]:
        """--keep-old-actor: this rank's shards of the weights the engines generated the rollout with.

        Samples carry the weight version the engine reported (`weight_versions`); the newest version of the
        rollout over all ranks is used. train_async.py trains on a rollout one weight push behind, so that
        is the previous push there, the latest push in train.py.
        """
        versions = data.get("weight_versions")
        if not versions or any(v in (None, "") for v in versions):
            raise ValueError(
                "--keep-old-actor needs the weight version each sample was generated with (the rollout data's "
                "weight_versions, from Sample.weight_versions): the default generate records the engine's "
                "meta_info weight_version; a custom generate function must append it too"
            )
        try:
            newest = max(int(v) for v in versions)
        except ValueError:
            raise ValueError(
                f"--keep-old-actor: weight versions {sorted(set(versions))} are not versions this trainer pushed"
            ) from None
        newest_tensor = torch.tensor([newest], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(newest_tensor, op=dist.ReduceOp.MAX)
        newest = int(newest_tensor.item())
        if newest not in self.pushed_weights:
            raise RuntimeError(
                f"--keep-old-actor: the rollout was generated with weight version {newest}, but the trainer keeps "
                f"only versions {sorted(self.pushed_weights)} (the last two pushes)"
            )
        return self.pushed_weights[newest]

    def _end_of_rollout(self, rollout_id: int) -> None:
        """--ref-update-interval: the reference becomes the actor every N rollouts; --reset-optimizer-states."""
        interval = self.args.ref_update_interval
        if self.ref_shards is not None and interval and (rollout_id + 1) % interval == 0:
            self.ref_shards = snapshot_local_shards(self.model, into=self.ref_shards)
        if self.args.reset_optimizer_states:
            # Zeroed moments and step count: the next step is a fresh AdamW's first step.
            with torch.no_grad():
                for state in self.optimizer.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            value.zero_()

    def compute_values(self, rollout_data: Any) -> list[list[float]]:
        """Critic: values of every response token of this rank's samples (PPO's GAE input for the actor).

        Returns:
            One list of floats per sample, in shard order.
        """
        data = self._prepare(rollout_data)
        values = self._forward_per_sample(self._micro_batches(data), len(data["tokens"]), "values")
        self._remember_values(data, values)
        return [v.tolist() for v in values]

    # ---- training ------------------------------------------------------------------------------
    def train(self, rollout_id: int, rollout_data: Any, values_refs: Any = None) -> dict[str, float]:
        """Train on this rank's shard of one rollout.

        Args:
            rollout_id: The rollout's id (passed to hooks and logs).
            rollout_data: This rank's shard (dict or ObjectRef).
            values_refs: Actor under PPO: the critic's values, as the list of every rank's `compute_values`
                ObjectRefs (this rank's entry is used) or as this rank's values themselves.

        Returns:
            Metrics averaged over the rollout's optimizer steps, identical on every rank.
        """
        data = self._prepare(rollout_data)
        steps = self._micro_batches(data)
        num_samples = len(data["tokens"])
        metrics: dict[str, float] = {}
        train_log_probs = None  # the trainer's log-probs of the rollout, compared with the engines'
        fuse_old_log_probs = self._old_log_probs_from_training_forward(data)
        if self.role == "critic":
            data["values"] = self._take_remembered_values(data)
            if data["values"] is None:
                data["values"] = self._forward_per_sample(steps, num_samples, "values")
        else:
            self._check_rollout_log_probs(data)
            if self.ref_shards is not None:
                data["ref_log_probs"] = self._reference_log_probs(steps, num_samples)
            if self.args.use_rollout_logprobs:
                data["log_probs"] = data["rollout_log_probs"]
                if self.args.get_mismatch_metrics:  # the trainer's own log-probs, only to measure the gap
                    train_log_probs = self._forward_per_sample(steps, num_samples, "log_probs")
            elif fuse_old_log_probs:
                data["log_probs"] = [None] * num_samples  # filled by the training forward
            elif not self._old_log_probs_unused(has_reference=self.ref_shards is not None):
                if self.args.keep_old_actor:  # the policy that generated the rollout, not the current weights
                    data["log_probs"] = self._log_probs_with(self._behaviour_shards(data), steps, num_samples)
                else:
                    data["log_probs"] = self._forward_per_sample(steps, num_samples, "log_probs")
            if values_refs is not None:
                data["values"] = self._values_for_this_rank(values_refs)
        if not self.args.disable_compute_advantages_and_returns:
            compute_advantages_and_returns(self.args, data, device=self._collective_device())
        if self.args.rollout_data_postprocess_path:
            load_function(self.args.rollout_data_postprocess_path)(self.args, rollout_id, data)

        metrics |= self._optimize(steps, data, fuse_old_log_probs)
        if not self.args.use_rollout_logprobs:
            train_log_probs = data.get("log_probs")
        if self.role == "actor" and train_log_probs is not None and data.get("rollout_log_probs") is not None:
            metrics["train_rollout_logprob_abs_diff"], metrics["train_rollout_logprob_max_abs_diff"] = (
                self._logprob_abs_diff(train_log_probs, data["rollout_log_probs"], data["loss_masks"])
            )
            if self.args.get_mismatch_metrics:
                metrics["train_rollout_kl"] = self._mismatch_kl(
                    train_log_probs, data["rollout_log_probs"], data["loss_masks"]
                )
        self._end_of_rollout(rollout_id)
        release_free_host_memory()  # the step's activations, or the trainer's resident size keeps growing
        return {f"{self.metric_prefix}{name}": value for name, value in metrics.items()}

    def _old_log_probs_from_training_forward(self, data: dict) -> bool:
        """Whether the old log-probs can come from the training forward itself instead of a separate pass.

        With one optimizer step per rollout the policy that the step starts from is the "old" policy,
        so its log-probs are the training forward's own (detached): bit-identical to a separate
        no-grad pass over the same micro-batches, at no extra forward. Only when nothing needs them
        before the step: no reference KL in the rewards, no custom advantage, hook or loss.
        """
        args = self.args
        return (
            self.role == "actor"
            and data["num_steps"] == 1
            and not args.use_rollout_logprobs
            and not args.keep_old_actor
            and self.ref_shards is None
            and args.loss_type == "policy_loss"
            and not getattr(args, "custom_advantage_function_path", None)
            and not args.rollout_data_postprocess_path
        )

    def _step_normalizers(self, steps: list[list[PackedMicroBatch]], data: dict) -> list[StepNormalizer]:
        """Sample and trainable-token counts of each step over all ranks (one all-reduce)."""
        # Zero-weight micro-batches are padding copies (equal forward counts across ranks): not counted.
        step_indices = [[i for mb in micro_batches if mb.weight for i in mb.sample_indices] for micro_batches in steps]
        counts = self._all_reduce(count_step_samples_and_tokens(step_indices, data["loss_masks"]))
        return [StepNormalizer.from_args(self.args, samples, tokens) for samples, tokens in counts.tolist()]

    def _optimize(
        self, steps: list[list[PackedMicroBatch]], data: dict, fill_old_log_probs: bool = False
    ) -> dict[str, float]:
        """Run one optimizer step per entry of `steps`; return metrics averaged over steps and reduced over ranks.

        With `fill_old_log_probs` (one step, see `_old_log_probs_from_training_forward`) each micro-batch's
        old log-probs are its own forward's, detached, and are stored into `data["log_probs"]`.
        """
        normalizers = self._step_normalizers(steps, data)
        if self.role == "critic":
            loss_function = value_loss
        else:
            loss_function = LOSS_FUNCTIONS[loss_kind(self.args.loss_type)]
        started = time.time()
        step_sums: list[dict[str, float]] = []
        grad_norms, lrs, skipped = [], [], 0
        for micro_batches, normalizer in zip(steps, normalizers, strict=True):
            sums: dict[str, float] = defaultdict(float)
            for micro_batch in micro_batches:
                batch = self._batch_inputs(micro_batch, data)
                if self.role == "critic":
                    output = response_values(self.model, micro_batch)
                else:
                    output = response_logits(self.model, micro_batch, self.args.rollout_temperature)
                if fill_old_log_probs:
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
            step_sums.append(sums)
            lrs.append(self.optimizer.param_groups[0]["lr"])
            grad_norm = self._clip_grad_norm()
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.lr_scheduler.step()
                grad_norms.append(grad_norm)
            elif getattr(self.args, "check_for_nan_in_loss_and_grad", True):
                raise FloatingPointError(
                    f"the gradient norm of optimizer step {len(step_sums)} of this rollout is {grad_norm} (NaN or "
                    "inf in the loss or gradients); pass --no-check-for-nan-in-loss-and-grad to skip such steps"
                )
            else:
                skipped += 1
                logger.warning("rank %d: grad norm is %s; skipping this optimizer step", self.rank, grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.time() - started

        names = sorted({name for sums in step_sums for name in sums})
        totals = torch.tensor([[sums.get(name, 0.0) for name in names] for sums in step_sums], dtype=torch.float64)
        totals = self._all_reduce(totals).mean(dim=0).tolist() if names else []
        metrics = dict(zip(names, totals, strict=True))
        tokens = self._all_reduce(torch.tensor([float(sum(data["total_lengths"]))], dtype=torch.float64)).item()
        metrics |= {
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "lr": sum(lrs) / len(lrs),
            "skipped_steps": float(skipped),
            "step_time": elapsed / len(steps),
            "tokens_per_s": tokens / max(elapsed, 1e-9),
        }
        return metrics

    def _clip_grad_norm(self) -> float:
        """Total gradient norm over all shards, clipping to `--clip-grad` when it is > 0."""
        max_norm = self.args.clip_grad if self.args.clip_grad and self.args.clip_grad > 0 else float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _logprob_abs_diff(
        self, a: list[torch.Tensor], b: list[torch.Tensor], masks: list[torch.Tensor]
    ) -> tuple[float, float]:
        """Mean and max of |a - b| over trainable tokens of all ranks (trainer vs engine log-probs)."""
        totals = torch.zeros(2, dtype=torch.float64)
        largest = torch.zeros(1, dtype=torch.float64)
        for x, y, mask in zip(a, b, masks, strict=True):
            diff = (torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)).abs() * mask
            totals[0] += float(diff.sum())
            totals[1] += float(mask.sum())
            largest = torch.maximum(largest, diff.max(dim=0, keepdim=True).values if diff.numel() else largest)
        totals = self._all_reduce(totals)
        largest = largest.to(self._collective_device())
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return float(totals[0] / totals[1].clamp_min(1)), float(largest.cpu())

    def _mismatch_kl(self, train: list[torch.Tensor], rollout: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
        """KL(engine policy || trainer policy) over trainable tokens of all ranks (k3 estimate on the engines'
        samples: r - 1 - log r with r = p_train / p_rollout)."""
        totals = torch.zeros(2, dtype=torch.float64)
        for x, y, mask in zip(train, rollout, masks, strict=True):
            log_ratio = torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)
            totals[0] += float(((log_ratio.exp() - 1 - log_ratio) * mask).sum())
            totals[1] += float(mask.sum())
        totals = self._all_reduce(totals)
        return float(totals[0] / totals[1].clamp_min(1))

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (via the training device under NCCL); returns a CPU tensor."""
        reduced = tensor.to(self._collective_device())
        dist.all_reduce(reduced)
        return reduced.cpu()

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_model(self, rollout_id: int, update_tracker: bool = True) -> None:
        """Checkpoint to `--save` (resumable) and, for the actor, export `--save-hf` (HF folder).

        `update_tracker=False`: the driver names the step in the tracker once every part of it is written.
        """
        root = self._checkpoint_root(self.args.save)
        if root:
            checkpoint.save_checkpoint(
                root,
                rollout_id,
                self.model,
                self.optimizer,
                self.lr_scheduler,
                save_optimizer=not getattr(self.args, "no_save_optim", False),
                role=self.role,
                update_tracker=update_tracker,
            )
        if self.role == "actor" and getattr(self.args, "save_hf", None):
            path = self.args.save_hf.format(rollout_id=rollout_id)
            checkpoint.save_hf_checkpoint(self.model, path, self.args.hf_checkpoint)

    # ---- weight sync ---------------------------------------------------------------------------
    def connect_rollout_engines(self, engines: list, engine_urls: list[str]) -> None:
        """Remember the engines; colocated: form span subgroups, disaggregated: rank 0 forms the broadcast group.

        Args:
            engines: Engine handles (RolloutEngine Ray actors, or clients with the same methods).
            engine_urls: Their base URLs (used to pick the address engines reach this rank at).
        """
        self.engine_links = connect_engines(self.args, engines, engine_urls, self.rank, self.dp_size)

    def update_weights(self) -> None:
        """Push the current weights to every engine (paused meanwhile) under the next weight version."""
        if self.engine_links is None or not self.engine_links.engines:
            raise RuntimeError("update_weights before connect_rollout_engines: the actor has no engines to update")
        dtype = torch.bfloat16 if getattr(self.args, "bf16", False) else None
        buckets = full_parameter_buckets(self.model, self.args.update_weight_buffer_size, dtype)
        update_engine_weights(self.engine_links, buckets, self.rank, str(self.weight_version + 1))
        self.weight_version += 1
        if self.args.keep_old_actor:
            # The two newest pushes: a rollout is generated at most one push behind the trainer.
            reuse = self.pushed_weights.pop(min(self.pushed_weights)) if len(self.pushed_weights) >= 2 else None
            self.pushed_weights[self.weight_version] = snapshot_local_shards(self.model, into=reuse)
        if self.args.check_weight_update_equal and self.weight_version == 1:
            self.check_weights_equal()

    def check_weights_equal(self) -> dict[str, float]:
        """Compare each engine's log-probs of a probe sequence with this trainer's (every rank must call).

        The CPU engine exposes no weights, so equality is checked through the model's output: the
        log-probs of a fixed probe sequence at temperature 1.

        Returns:
            {"max_abs_diff": largest gap over engines and tokens} (rank 0; 0.0 elsewhere).

        Raises:
            RuntimeError: on rank 0 when the gap exceeds `weight_sync.WEIGHT_CHECK_TOLERANCE`.
        """
        vocab_size = self.model.get_input_embeddings().weight.shape[0]
        probe = probe_tokens(vocab_size)
        probe_data = {"tokens": [probe], "response_lengths": [len(probe) - 1]}
        micro_batches = build_step_micro_batches(
            probe_data["tokens"],
            probe_data["response_lengths"],
            num_steps=1,
            micro_batch_size=1,
            max_tokens=None,
            device=self.device,
            attn_implementation=self.attn_implementation,
        )
        trainer = self._forward_per_sample(micro_batches, 1, "log_probs", temperature=1.0)[0]
        if self.rank != 0:
            return {"max_abs_diff": 0.0}
        engines = self.engine_links.engines if self.engine_links else []
        gap = check_engines_match(engines, probe, trainer, self.weight_version)
        logger.info("weight check passed: max probe log-prob gap %.3g", gap)
        return {"max_abs_diff": gap}

    # ---- offload -------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free training memory while the engines generate: drop gradients; on GPU also move weights
        and optimizer state to CPU and release the CUDA cache. On CPU nothing else can be freed."""
        self.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            self.model.to("cpu")
            _move_optimizer_state(self.optimizer, torch.device("cpu"))
            torch.cuda.empty_cache()
        release_free_host_memory()

    def wake_up(self) -> None:
        """Undo `sleep`: weights and optimizer state back on the training device."""
        if torch.cuda.is_available():
            self.model.to(self.device)
            _move_optimizer_state(self.optimizer, self.device)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
