"""Backend-neutral training rank: the per-rollout recipe, written once, over a small backend interface.

`RayTrainGroup` (slime/ray) creates one actor per training rank and calls, on every rank at once:

    start_rollout_id = init(args, role, with_ref)        role "actor" or "critic"; with_ref keeps the
                                                         reference weights for KL terms
    connect_rollout_engines(engines, engine_urls)        actor only, before the first update
    update_weights()                                     actor only; after init and after each train
    check_weights_equal() -> dict                        actor only, optional (--check-weight-update-equal
                                                         also runs it after the first update)
    per rollout:
      PPO: values = critic.compute_values(rollout_data)  per rank: list of per-sample value lists
           actor.train(rollout_id, rollout_data, values_refs=[every rank's compute_values ref])
           critic.train(rollout_id, rollout_data)        may run concurrently with the actor
      else: actor.train(rollout_id, rollout_data)
      save_model(rollout_id)                             at --save-interval
      offload() / onload()                               around generation with --offload-train

`rollout_data` is this rank's shard from `split_train_data_by_dp` (or a Ray ObjectRef to it). `train`
returns the rollout's metrics, identical on every rank: the actor's named `train/<name>`, the critic's
plain `<name>` (the driver prefixes them).

`train` follows Megatron's `train_actor` order: reference log-probs (the reference weights are copied
into the one model and back: no second model), old log-probs with the current weights (the engines'
with `--use-rollout-logprobs`; the generating weights with `--keep-old-actor`), advantages and returns
(slime.algorithms; with `--use-opd` less the reverse KL to the teacher's `teacher_log_probs`), the
`--rollout-data-postprocess-path` hook, then `num_steps` optimizer steps over the same packed micro-batches.
The critic takes its values from its own `compute_values` of the shard and computes returns by GAE with a zero
reward-side KL.

What differs between runs is chosen once, in `init`, never by branching on the role in the recipe: the role's
loss, inputs and names; where the old log-probs come from (`OldLogProbSource`: the engines', a forward with the
current weights, the training forward itself, or the kept weights that generated the rollout); the
`--custom-*-path` hooks the recipe calls; and, for the actor, a `WeightUpdater` (slime.backends.weight_sync)
whose transport is chosen when the engines connect.

LoRA (`--lora-rank`, `self.lora`): the actor trains an adapter on its frozen base. What that changes is decided here,
for both backends: the reference model is the base itself (`reference_is_base`: the adapter switched off, no
reference weights), a weight update pushes only the adapter (PEFT saved names, `LoraAdapterTransport`), and
`--save-hf` writes a PEFT adapter folder. The backend builds the adapter and keeps it (and its optimizer state) in
its checkpoints, with a PEFT folder `iter_XXXXXXX/adapter/` beside.

A backend (fsdp_utils, megatron_utils) subclasses `TrainRayActor` and supplies what differs: `_build`
(model, optimizer, loading; the adapter under LoRA), `_micro_batches`, `_forward_log_probs` / `_forward_values`,
`_step_gradients` and `_optimizer_step` (one optimizer step), `_snapshot_weights` / `_load_weights`,
`_model_weight_buckets`, `_probe_micro_batches`, `_save_checkpoint` / `_save_hf`, `offload` / `onload`, and
`loss_functions`; under LoRA also `_adapter_tensors`, `_adapter_config` and `_adapters_disabled`. It lives beside
the backends, not in slime/ray, because they build on it and layers only import downward.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from transformers import AutoConfig

from slime.algorithms.advantages import compute_advantages_and_returns
from slime.algorithms.aggregation import StepNormalizer, count_step_samples_and_tokens
from slime.algorithms.losses import value_loss
from slime.algorithms.policy_losses import loss_kind
from slime.backends.weight_sync import WeightUpdater, choose_transport
from slime.utils.device import cuda_available, distributed_backend
from slime.utils.lora import lora_enabled
from slime.utils.lora_export import save_adapter_export
from slime.utils.misc import load_function, load_pretrained, release_free_host_memory
from slime.utils.perf import ModelShape, PhaseTimer, device_peak_tflops, forward_flops, peak_memory_gb
from slime.utils.weight_sync import Bucket, bucket_named_tensors, probe_tokens
from slime.utils.weight_transport import host_group_store

logger = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


# ---- where the old log-probs come from ------------------------------------------------------------------------
class OldLogProbSource:
    """Where `train` takes the old policy's log-probs, `data["log_probs"]`, from; chosen once at init
    (`choose_old_log_prob_source`). This one takes none: nothing reads them (the critic; the SFT loss without
    a reference)."""

    def fuses(self, data: dict) -> bool:
        """Whether the training forward fills them for this rollout (`_step_gradients`' `fill`)."""
        return False

    def fill(self, trainer: TrainRayActor, data: dict, steps: list[list], timer: PhaseTimer) -> list | None:
        """Set `data["log_probs"]` before the advantages; return the trainer's own log-probs of the rollout if it
        computed them beside the old ones, only to compare them with the engines'."""
        return None

    def compared(self, data: dict, own: list | None) -> list | None:
        """After the optimizer steps: the trainer's log-probs of the rollout, compared with the engines'."""
        return data.get("log_probs")

    def after_push(self, trainer: TrainRayActor, version: int) -> None:
        """Called on every rank after weight push `version`."""


class CurrentWeightLogProbs(OldLogProbSource):
    """A forward pass with the current weights before the optimizer steps."""

    def fill(self, trainer: TrainRayActor, data: dict, steps: list[list], timer: PhaseTimer) -> None:
        with timer.phase("log_probs"):
            data["log_probs"] = trainer._forward_log_probs(steps, len(data["tokens"]))


class FusedForwardLogProbs(CurrentWeightLogProbs):
    """With one optimizer step in the rollout, the training forward's own (detached): the policy the step starts
    from is the old one, so they equal a separate pass's at no extra forward. A rollout of several steps takes a
    separate pass."""

    def fuses(self, data: dict) -> bool:
        return data["num_steps"] == 1

    def fill(self, trainer: TrainRayActor, data: dict, steps: list[list], timer: PhaseTimer) -> None:
        if not self.fuses(data):
            return super().fill(trainer, data, steps, timer)
        data["log_probs"] = [None] * len(data["tokens"])  # filled by the training forward
        return None


class KeptWeightLogProbs(OldLogProbSource):
    """--keep-old-actor: a forward with this rank's copy of the weights the engines generated the rollout with.

    A copy is taken after every push; the two newest are kept, since a rollout is generated at most one push
    behind the trainer (train_async.py trains on a rollout one push behind, train.py on the latest push).
    """

    def __init__(self):
        self.pushed: dict[int, Weights] = {}  # weight version -> CPU copy of this rank's weights then

    def after_push(self, trainer: TrainRayActor, version: int) -> None:
        reuse = self.pushed.pop(min(self.pushed)) if len(self.pushed) >= 2 else None
        self.pushed[version] = trainer._snapshot_weights(into=reuse)

    def fill(self, trainer: TrainRayActor, data: dict, steps: list[list], timer: PhaseTimer) -> None:
        with timer.phase("log_probs"):
            weights = self._behaviour_weights(trainer, data)
            data["log_probs"] = trainer._log_probs_with(weights, steps, len(data["tokens"]))

    def _behaviour_weights(self, trainer: TrainRayActor, data: dict) -> Weights:
        """The kept copy of the newest weight version the rollout's samples carry (`weight_versions`, the
        version the engine reported), over all data-parallel ranks."""
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
        newest_tensor = torch.tensor([newest], dtype=torch.int64)
        newest = int(trainer._all_reduce(newest_tensor, trainer._data_parallel_group(), dist.ReduceOp.MAX).item())
        if newest not in self.pushed:
            raise RuntimeError(
                f"--keep-old-actor: the rollout was generated with weight version {newest}, but the trainer keeps "
                f"only versions {sorted(self.pushed)} (the last two pushes)"
            )
        return self.pushed[newest]


class EngineLogProbs(OldLogProbSource):
    """--use-rollout-logprobs: the engines' own. With `measure_mismatch` (--get-mismatch-metrics) the trainer
    also runs a forward with the current weights, only to measure the gap to them."""

    def __init__(self, measure_mismatch: bool):
        self.measure_mismatch = measure_mismatch

    def fill(self, trainer: TrainRayActor, data: dict, steps: list[list], timer: PhaseTimer) -> list | None:
        data["log_probs"] = data["rollout_log_probs"]
        return trainer._forward_log_probs(steps, len(data["tokens"])) if self.measure_mismatch else None

    def compared(self, data: dict, own: list | None) -> list | None:
        return own


def choose_old_log_prob_source(args, has_reference: bool, can_fuse: bool) -> OldLogProbSource:
    """The actor's old-log-prob source from its flags.

    Args:
        args: Parsed slime arguments.
        has_reference: The actor keeps reference weights (a KL term reads the old log-probs too).
        can_fuse: The backend's `_step_gradients` can fill them from the training forward.
    """
    if args.use_rollout_logprobs:
        return EngineLogProbs(args.get_mismatch_metrics)
    if can_fuse and _nothing_reads_old_log_probs_before_the_step(args, has_reference):
        return FusedForwardLogProbs()
    if args.loss_type == "sft_loss" and not has_reference:  # the SFT loss reads the current log-probs only
        return OldLogProbSource()
    if args.keep_old_actor:
        return KeptWeightLogProbs()
    return CurrentWeightLogProbs()


def _nothing_reads_old_log_probs_before_the_step(args, has_reference: bool) -> bool:
    """Whether the old log-probs may wait for the training forward: no reference KL in the rewards, no kept
    weights, the policy loss, and no custom advantage, hook or teacher term that reads them (or changes the
    weights) before the step."""
    return (
        not args.keep_old_actor
        and not has_reference
        and args.loss_type == "policy_loss"
        and not args.custom_advantage_function_path
        and not args.rollout_data_postprocess_path
        and not args.custom_megatron_before_train_step_hook_path  # may change the weights
        and not args.use_opd  # the teacher term needs the student's old log-probs before the step
    )


def _load_hook(path: str | None) -> Callable | None:
    return load_function(path) if path else None


class TrainRayActor:
    """One training rank. Construct through Ray; the driver then calls `init` on every rank at once.

    Args:
        world_size: Number of training ranks.
        rank: This rank.
        master_addr: Rendezvous host of rank 0 (None on rank 0 itself: it picks one and reports it).
        master_port: Rendezvous port of rank 0.
    """

    # The backend's loss functions by `loss_kind` ("policy", "sft", "custom"); the critic uses `value_loss`.
    loss_functions: dict[str, Callable] = {}
    # Whether `_step_gradients` can store the training forward's log-probs as the old ones (`FusedForwardLogProbs`).
    fuses_old_log_probs: bool = False

    def __init__(self, world_size: int, rank: int, master_addr: str | None, master_port: int | None):
        self.world_size = world_size
        self.rank = rank
        # Rank 0 of a group the driver builds hosts the rendezvous store now, on a port the kernel picks as it binds,
        # and reports it (`get_master_addr_and_port`): a port probed free here and bound at `init_process_group`,
        # after the other ranks start, could be taken in between.
        self._store: dist.TCPStore | None = None
        if master_addr is None:
            master_addr = ray.util.get_node_ip_address() if cuda_available() else "127.0.0.1"
            self._store = host_group_store(master_addr, world_size)
            master_port = self._store.port
        self.master_addr, self.master_port = master_addr, master_port
        # critic: values from `compute_values`, kept for `train` on the same shard (`_remember_values`)
        self.cached_values: tuple[tuple, list[torch.Tensor]] | None = None
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(self._local_rank()),
        )

    def _local_rank(self) -> int:
        # Outside a Ray worker (a trainer built in-process) ray.get_gpu_ids() would start a local Ray instance.
        gpu_ids = ray.get_gpu_ids() if cuda_available() and ray.is_initialized() else []
        return int(gpu_ids[0]) if gpu_ids else 0

    def get_master_addr_and_port(self) -> tuple[str, int]:
        return self.master_addr, self.master_port

    def init_process_group(self, args) -> None:
        """Join the training process group (`--distributed-backend`: NCCL on GPU, gloo on CPU by default);
        set this rank's thread budget."""
        if cuda_available():
            torch.cuda.set_device(self._local_rank())
        else:
            torch.set_num_threads(args.train_num_threads)
        backend = args.distributed_backend or distributed_backend()
        if not dist.is_initialized():
            timeout = timedelta(minutes=args.distributed_timeout_minutes)
            store = self._store or dist.TCPStore(
                self.master_addr, self.master_port, self.world_size, is_master=self.rank == 0, timeout=timeout
            )
            store.set_timeout(timeout)
            dist.init_process_group(
                backend=backend, store=store, world_size=self.world_size, rank=self.rank, timeout=timeout
            )
        self._store = None  # the group holds it from here on

    # ---- setup ---------------------------------------------------------------------------------
    def init(self, args, role: str, with_ref: bool = False) -> int:
        """Build model and optimizer (loading `--load` if set); return the rollout id to start from.

        Args:
            args: Parsed slime arguments.
            role: "actor", or "critic" (PPO's value model).
            with_ref: Keep the reference weights for `--use-kl-loss` / `--kl-coef` (actor only).

        Returns:
            The checkpoint's rollout id + 1 when resuming from `--load`, else 0.
        """
        if role not in ("actor", "critic"):
            raise ValueError(f"unknown role {role!r}; use 'actor' or 'critic'")
        with_ref = with_ref and role == "actor"
        if role == "actor" and (args.use_kl_loss or args.kl_coef != 0) and not with_ref:
            raise ValueError("--use-kl-loss / --kl-coef need reference log-probs: init the actor with with_ref=True")
        self.args, self.role = args, role
        self.ref_weights: Weights | None = None  # set by `_build` when with_ref
        # --lora-rank: the actor trains an adapter on its frozen base, which is also the reference model (the adapter
        # switched off), so no reference weights are kept.
        self.lora = role == "actor" and lora_enabled(args)
        self.reference_is_base = self.lora and with_ref
        self.actor_backup: Weights | None = None
        # --use-rollout-routing-replay: the policy's forwards route as the engines did (off for the reference)
        self.replay_routing = role == "actor" and args.use_rollout_routing_replay
        # What the role changes, decided here once (the role itself only names metrics, phases and logs).
        self.value_head = role == "critic"  # the model ends in PPO's value head, not the LM head
        self.metric_prefix = "train/" if role == "actor" else ""
        self.checkpoint_subfolder = None if role == "actor" else "critic"
        if role == "actor":
            self.loss_function = self.loss_functions[loss_kind(args.loss_type)]
            self._fill_train_inputs = self._fill_policy_inputs
            self.old_log_probs = choose_old_log_prob_source(args, with_ref, self.fuses_old_log_probs)
            self.weight_updater = WeightUpdater(self.rank, check_first_push=args.check_weight_update_equal)
            self.hf_export = args.save_hf
        else:
            self.loss_function = value_loss
            self._fill_train_inputs = self._fill_value_inputs
            self.old_log_probs = OldLogProbSource()
            self.weight_updater = None
            self.hf_export = None
        self.rollout_data_postprocess = _load_hook(args.rollout_data_postprocess_path)
        self.before_train_step = _load_hook(args.custom_megatron_before_train_step_hook_path)
        self.init_process_group(args)
        self.model_shape = (
            ModelShape.from_hf_config(load_pretrained(AutoConfig, args.hf_checkpoint, args.trust_remote_code))
            if args.hf_checkpoint
            else None
        )
        self.peak_tflops = device_peak_tflops(args.peak_tflops)
        return self._build(args, with_ref and not self.lora)

    def _checkpoint_root(self, folder: str | None) -> str | None:
        """Where this role's checkpoints live under `--save` / `--load` (the critic uses a subfolder)."""
        if not folder:
            return None
        return os.path.join(folder, self.checkpoint_subfolder) if self.checkpoint_subfolder else folder

    @property
    def weight_version(self) -> int:
        """The actor's last weight version pushed to the engines (0 before the first push)."""
        return self.weight_updater.version

    # ---- data ----------------------------------------------------------------------------------
    def _prepare(self, rollout_data: Any) -> dict:
        """This rank's shard as a dict with per-sample float tensors for the per-token fields."""
        if isinstance(rollout_data, ray.ObjectRef):
            rollout_data = ray.get(rollout_data)
        data = dict(rollout_data)
        data["loss_masks"] = [torch.as_tensor(mask, dtype=torch.float32) for mask in data["loss_masks"]]
        for key in ("rollout_log_probs", "teacher_log_probs"):
            if data.get(key) is not None:
                data[key] = [torch.as_tensor(lp, dtype=torch.float32) for lp in data[key]]
        data["total_lengths"] = [len(tokens) for tokens in data["tokens"]]
        data.setdefault("num_steps", self.args.num_steps_per_rollout)
        return data

    def _batch_inputs(self, micro_batch: Any, data: dict) -> dict:
        """The micro-batch's slice of every per-sample field of `data`, tensors on the training device."""
        num_samples = len(data["tokens"])
        batch = {}
        for key, values in data.items():
            if key == "rollout_routed_experts":  # laid out with the tokens by `_micro_batches`, not a loss input
                continue
            if isinstance(values, list) and len(values) == num_samples:
                picked = [values[i] for i in micro_batch.sample_indices]
                batch[key] = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in picked]
        batch["target_tokens"] = micro_batch.target_tokens
        batch["response_lengths"] = micro_batch.response_lengths
        return batch

    def _values_for_this_rank(self, values: Any) -> list[torch.Tensor]:
        """The critic's values for this rank's shard: given as every rank's ObjectRefs, one ref, or the values."""
        if isinstance(values, list) and values and isinstance(values[0], ray.ObjectRef):
            values = values[self.rank]
        if isinstance(values, ray.ObjectRef):
            values = ray.get(values)
        return [torch.as_tensor(v, dtype=torch.float32) for v in values]

    # ---- the per-rollout recipe ----------------------------------------------------------------
    def compute_values(self, rollout_data: Any) -> list[list[float]]:
        """Critic: the value of every response token of this rank's samples (the actor's GAE input for PPO).

        The values are kept for this rollout's `train`, which needs the same ones as its "old" values.

        Args:
            rollout_data: This rank's shard (dict or ObjectRef).

        Returns:
            One list of floats per sample, in shard order (equal on every rank of a model-parallel group).
        """
        if not self.value_head:
            raise RuntimeError("compute_values is the critic's: init this rank with role 'critic'")
        data = self._prepare(rollout_data)
        values = self._forward_values(self._micro_batches(data), len(data["tokens"]))
        self._remember_values(data, values)
        return [value.tolist() for value in values]

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
        self._check_rollout_routing(data)
        steps = self._micro_batches(data)
        timer = PhaseTimer()
        fuse_old_log_probs = self._can_fuse_old_log_probs(data)
        own_log_probs = self._fill_train_inputs(data, steps, values_refs, timer)
        if not self.args.disable_compute_advantages_and_returns:
            compute_advantages_and_returns(self.args, data, self._data_parallel_group(), self._collective_device())
        if self.rollout_data_postprocess is not None:
            self.rollout_data_postprocess(self.args, rollout_id, data)

        with timer.phase(f"{self.role}_train"):
            metrics = self._optimize(rollout_id, steps, data, fuse_old_log_probs)
        if data.get("opd_reverse_kl") is not None:  # mean log pi_student - log pi_teacher over trainable tokens
            metrics["opd_reverse_kl"] = self._masked_token_mean(data["opd_reverse_kl"], data["loss_masks"])
        train_log_probs = self.old_log_probs.compared(data, own_log_probs)
        if train_log_probs is not None and data.get("rollout_log_probs") is not None:
            metrics["train_rollout_logprob_abs_diff"], metrics["train_rollout_logprob_max_abs_diff"] = (
                self._logprob_abs_diff(train_log_probs, data["rollout_log_probs"], data["loss_masks"])
            )
            if self.args.get_mismatch_metrics:
                metrics["train_rollout_kl"] = self._mismatch_kl(
                    train_log_probs, data["rollout_log_probs"], data["loss_masks"]
                )
        self._end_of_rollout(rollout_id)
        release_free_host_memory()  # the step's activations, or the trainer's resident size keeps growing
        return {f"{self.metric_prefix}{name}": value for name, value in metrics.items()} | self._perf_metrics(
            timer, data, steps
        )

    def _fill_policy_inputs(self, data: dict, steps: list[list], values_refs: Any, timer: PhaseTimer) -> list | None:
        """Actor: reference and old log-probs, and under PPO the critic's values; returns the trainer's own
        log-probs where the old ones are not the trainer's (`OldLogProbSource.fill`)."""
        self._check_rollout_log_probs(data)
        self._check_teacher_log_probs(data)
        if self.ref_weights is not None or self.reference_is_base:
            with timer.phase("ref_log_probs"), self._routing_replay_off():
                data["ref_log_probs"] = self._reference_log_probs(steps, len(data["tokens"]))
        own_log_probs = self.old_log_probs.fill(self, data, steps, timer)
        if values_refs is not None:
            data["values"] = self._values_for_this_rank(values_refs)
        return own_log_probs

    def _fill_value_inputs(self, data: dict, steps: list[list], values_refs: Any, timer: PhaseTimer) -> None:
        """Critic: its own values of the shard, those `compute_values` kept or a forward now."""
        data["values"] = self._take_remembered_values(data)
        if data["values"] is None:
            with timer.phase("values"):
                data["values"] = self._forward_values(steps, len(data["tokens"]))

    def _perf_metrics(self, timer: PhaseTimer, data: dict, steps: list[list]) -> dict[str, float]:
        """Phase times of this rank, TFLOPs and MFU per device of the training step, peak memory over ranks."""
        role = self.role
        out = {f"perf/{name}_time": seconds for name, seconds in timer.seconds.items()}
        peak = torch.tensor([peak_memory_gb()], dtype=torch.float64)
        out[f"perf/{role}_peak_memory_gb"] = self._all_reduce(peak, None, dist.ReduceOp.MAX).item()
        if self.model_shape is None:
            return out
        # The sequences this rank's forwards ran over (not padding micro-batches), summed over the data-parallel
        # group: the FLOPs the whole group did.
        micro_batches = [mb for step in steps for mb in step if getattr(mb, "weight", 1.0)]
        lengths = [n for mb in micro_batches for n in self._sequence_lengths(mb, data)]
        head = [getattr(mb, "head_tokens", None) for mb in micro_batches]  # positions whose logits are computed
        flops = forward_flops(self.model_shape, lengths, None if None in head else sum(head))
        local = torch.tensor([flops], dtype=torch.float64)
        total = self._all_reduce(local, self._data_parallel_group()).item()
        per_device = 3 * total / dist.get_world_size() / max(timer.seconds[f"{role}_train"], 1e-9) / 1e12
        out[f"perf/{role}_train_tflops"] = per_device
        if self.peak_tflops:
            out[f"perf/{role}_train_mfu"] = per_device / self.peak_tflops
        return out

    def _sequence_lengths(self, micro_batch: Any, data: dict) -> list[int]:
        """Tokens of each sequence a micro-batch's forward runs over: its samples, unless the backend lays
        samples out otherwise (FSDP's shared-prompt rows compute a prompt once for all its responses)."""
        lengths = getattr(micro_batch, "sequence_lengths", None)
        return lengths if lengths else [data["total_lengths"][i] for i in micro_batch.sample_indices]

    @contextlib.contextmanager
    def _routing_replay_off(self) -> Iterator[None]:
        """The reference model routes tokens itself: replaying the engines' routing is for the policy."""
        replay, self.replay_routing = self.replay_routing, False
        try:
            yield
        finally:
            self.replay_routing = replay

    def _check_rollout_routing(self, data: dict) -> None:
        """Refuse `--use-rollout-routing-replay` on data without the engines' routed experts."""
        if self.replay_routing and data.get("rollout_routed_experts") is None:
            raise ValueError(
                "--use-rollout-routing-replay needs every sample's rollout_routed_experts, but the rollout data has "
                "none; the default rollout records them, a custom generate function must set "
                "sample.rollout_routed_experts (slime.utils.moe_routing)"
            )

    def _check_rollout_log_probs(self, data: dict) -> None:
        """Refuse `--use-rollout-logprobs` / `--use-tis` on data without the engines' log-probs."""
        if (self.args.use_rollout_logprobs or self.args.use_tis) and data.get("rollout_log_probs") is None:
            raise ValueError(
                "--use-rollout-logprobs / --use-tis need the engines' log-probs, but the rollout data has no "
                "rollout_log_probs; make the rollout function record them (return_logprob)"
            )

    def _check_teacher_log_probs(self, data: dict) -> None:
        """Refuse `--use-opd` on data without the teacher's log-probs of every response token."""
        if not self.args.use_opd:
            return
        if data.get("teacher_log_probs") is None:
            raise ValueError(
                "--use-opd needs the teacher's log-probs of every response token, but the rollout data has no "
                "teacher_log_probs; pass --opd-teacher-url (the default rollout then asks the teacher engine), or "
                "set Sample.teacher_log_probs on every sample in your rollout, generate or reward code"
            )
        indices = data.get("sample_indices") or range(len(data["tokens"]))
        for index, teacher, length in zip(indices, data["teacher_log_probs"], data["response_lengths"], strict=True):
            if teacher.numel() != length:
                raise ValueError(
                    f"sample {index} has {teacher.numel()} teacher log-probs for {length} response tokens; "
                    "Sample.teacher_log_probs must hold one log-prob per response token"
                )

    def _can_fuse_old_log_probs(self, data: dict) -> bool:
        """Whether `_step_gradients` fills `data["log_probs"]` from the training forward itself in this rollout
        (one forward pass less)."""
        return self.old_log_probs.fuses(data)

    def _remember_values(self, data: dict, values: list[torch.Tensor]) -> None:
        """Critic: keep `compute_values`' values for the `train` call on the same shard."""
        self.cached_values = (_shard_key(data), values)

    def _take_remembered_values(self, data: dict) -> list[torch.Tensor] | None:
        """Critic: the values `compute_values` kept for this shard (None if it was another one); forgets them."""
        cached, self.cached_values = self.cached_values, None
        return cached[1] if cached is not None and cached[0] == _shard_key(data) else None

    def _reference_log_probs(self, steps: list, num_samples: int) -> list[torch.Tensor]:
        """This rank's reference log-probs (`--use-kl-loss`, `--kl-coef`): the reference weights swapped in, or under
        LoRA the base model's (the adapter switched off)."""
        if self.reference_is_base:
            with self._adapters_disabled():
                return self._forward_log_probs(steps, num_samples)
        return self._log_probs_with(self.ref_weights, steps, num_samples)

    def _log_probs_with(self, weights: Weights, steps: list, num_samples: int) -> list[torch.Tensor]:
        """Log-probs of other weights (this rank's part, e.g. the reference): swapped into the model and back."""
        self.actor_backup = self._snapshot_weights(into=self.actor_backup)
        self._load_weights(weights)
        try:
            return self._forward_log_probs(steps, num_samples)
        finally:
            self._load_weights(self.actor_backup)

    def _end_of_rollout(self, rollout_id: int) -> None:
        """--ref-update-interval: the reference becomes the actor every N rollouts; --reset-optimizer-states."""
        interval = self.args.ref_update_interval
        if self.ref_weights is not None and interval and (rollout_id + 1) % interval == 0:
            self.ref_weights = self._snapshot_weights(into=self.ref_weights)
        if self.args.reset_optimizer_states:
            self._reset_optimizer_states()

    # ---- optimizer steps -----------------------------------------------------------------------
    def _optimize(self, rollout_id: int, steps: list[list], data: dict, fill_old_log_probs: bool) -> dict[str, float]:
        """Run one optimizer step per entry of `steps`; return metrics averaged over steps and reduced over ranks."""
        normalizers = self._step_normalizers(steps, data)
        started = time.time()
        step_sums: list[dict[str, float]] = []
        grad_norms, lrs, skipped = [], [], 0
        for step_id, (micro_batches, normalizer) in enumerate(zip(steps, normalizers, strict=True)):
            if self.before_train_step is not None:
                self.before_train_step(self.args, rollout_id, step_id, self.model, self.optimizer, self.lr_scheduler)
            step_sums.append(
                self._step_gradients(micro_batches, data, self.loss_function, normalizer, fill_old_log_probs)
            )
            lrs.append(self.optimizer.param_groups[0]["lr"])
            grad_norm = self._optimizer_step()
            if math.isfinite(grad_norm):
                grad_norms.append(grad_norm)
            elif self._stop_on_non_finite_grad():
                raise FloatingPointError(
                    f"the gradient norm of optimizer step {step_id + 1} of this rollout is {grad_norm} (NaN or "
                    "inf in the loss or gradients); pass --no-check-for-nan-in-loss-and-grad to skip such steps"
                )
            else:
                skipped += 1
                logger.warning("rank %d: grad norm is %s; skipping this optimizer step", self.rank, grad_norm)
        elapsed = time.time() - started

        metrics = self._mean_over_steps(step_sums)
        local_tokens = torch.tensor([float(sum(data["total_lengths"]))], dtype=torch.float64)
        tokens = self._all_reduce(local_tokens, self._data_parallel_group()).item()
        metrics |= {
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "lr": sum(lrs) / len(lrs),
            "skipped_steps": float(skipped),
            "step_time": elapsed / len(steps),
            "tokens_per_s": tokens / max(elapsed, 1e-9),
        }
        return metrics

    def _step_normalizers(self, steps: list[list], data: dict) -> list[StepNormalizer]:
        """Sample and trainable-token counts of each step over the data-parallel group (one all-reduce)."""
        # Zero-weight micro-batches (FSDP) are padding copies that keep forward counts equal: not counted.
        step_indices = [
            [i for mb in micro_batches if getattr(mb, "weight", 1.0) for i in mb.sample_indices]
            for micro_batches in steps
        ]
        counts = count_step_samples_and_tokens(step_indices, data["loss_masks"])
        counts = self._all_reduce(counts, self._data_parallel_group())
        return [StepNormalizer.from_args(self.args, samples, tokens) for samples, tokens in counts.tolist()]

    def _mean_over_steps(self, step_sums: list[dict[str, float]]) -> dict[str, float]:
        """Each loss metric summed over all ranks, averaged over the steps. Ranks may report different
        names (Megatron: only metric-reporting ranks have any), so the names are gathered first."""
        names = sorted({name for sums in step_sums for name in sums})
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, names)
        names = sorted({name for rank_names in every_rank for name in rank_names})
        if not names:
            return {}
        totals = torch.tensor([[sums.get(name, 0.0) for name in names] for sums in step_sums], dtype=torch.float64)
        return dict(zip(names, self._all_reduce(totals).mean(dim=0).tolist(), strict=True))

    def _stop_on_non_finite_grad(self) -> bool:
        """A non-finite gradient norm stops the run unless --no-check-for-nan-in-loss-and-grad."""
        return self.args.check_for_nan_in_loss_and_grad  # an FSDP flag; the Megatron actor overrides this

    # ---- collectives and log-prob gap metrics --------------------------------------------------
    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's data-parallel peers (None: all ranks)."""
        return None

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _all_reduce(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: dist.ReduceOp = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce over `group` (default: all ranks), via the training device under NCCL; returns a CPU tensor."""
        reduced = tensor.to(self._collective_device())
        dist.all_reduce(reduced, op=op, group=group)
        return reduced.cpu()

    def _logprob_abs_diff(
        self, a: list[torch.Tensor], b: list[torch.Tensor], masks: list[torch.Tensor]
    ) -> tuple[float, float]:
        """Mean and max of |a - b| over trainable tokens of the data-parallel group (trainer vs engine)."""
        totals = torch.zeros(2, dtype=torch.float64)
        largest = torch.zeros(1, dtype=torch.float64)
        for x, y, mask in zip(a, b, masks, strict=True):
            diff = (torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)).abs() * mask
            totals[0] += float(diff.sum())
            totals[1] += float(mask.sum())
            if diff.numel():
                largest = torch.maximum(largest, diff.max().reshape(1))
        group = self._data_parallel_group()
        totals = self._all_reduce(totals, group)
        largest = self._all_reduce(largest, group, dist.ReduceOp.MAX)
        return float(totals[0] / totals[1].clamp_min(1)), float(largest)

    def _masked_token_mean(self, values: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
        """Mean of per-token `values` over the trainable tokens of the data-parallel group."""
        totals = torch.zeros(2, dtype=torch.float64)
        for value, mask in zip(values, masks, strict=True):
            totals[0] += float((value.double() * mask).sum())
            totals[1] += float(mask.sum())
        totals = self._all_reduce(totals, self._data_parallel_group())
        return float(totals[0] / totals[1].clamp_min(1))

    def _mismatch_kl(self, train: list[torch.Tensor], rollout: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
        """KL(engine policy || trainer policy) over trainable tokens of the data-parallel group (k3 estimate
        on the engines' samples: r - 1 - log r with r = p_train / p_rollout)."""
        totals = torch.zeros(2, dtype=torch.float64)
        for x, y, mask in zip(train, rollout, masks, strict=True):
            log_ratio = torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)
            totals[0] += float(((log_ratio.exp() - 1 - log_ratio) * mask).sum())
            totals[1] += float(mask.sum())
        totals = self._all_reduce(totals, self._data_parallel_group())
        return float(totals[0] / totals[1].clamp_min(1))

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_model(self, rollout_id: int, update_tracker: bool = True) -> None:
        """Checkpoint this role to `--save` (resumable; the critic's to `<save>/critic`) and, for the actor,
        export `--save-hf` (HF folder). `update_tracker=False`: the driver names the step in the tracker
        once every part of it is written."""
        root = self._checkpoint_root(self.args.save)
        if root:
            self._save_checkpoint(root, rollout_id, update_tracker)
        if not self.hf_export:
            return
        path = self.hf_export.format(rollout_id=rollout_id)
        if not self.lora:
            self._save_hf(path)
            return

        def gather() -> dict[str, torch.Tensor]:
            return dict(self._adapter_tensors(None))

        # The adapter, as a PEFT folder; tools/convert_to_hf.py --merge-lora folds it into the base.
        args = self.args
        save_adapter_export(path, gather, self._adapter_config(), args.hf_checkpoint, args.trust_remote_code)

    # ---- weight sync ---------------------------------------------------------------------------
    def connect_rollout_engines(self, engines: list, engine_urls: list[str]) -> None:
        """Remember the engines; colocated: form span subgroups, disaggregated: rank 0 forms the broadcast group,
        or with `--update-weight-transport disk` checks `--update-weight-disk-dir`. May be called again (restarted
        engines); disk sync then goes on cleaning up the folders it pushed before.

        Args:
            engines: Engine handles (RolloutEngine Ray actors, or clients with the same methods, e.g. the
                `EngineClient`s of `--rollout-external-engine-addrs`).
            engine_urls: Their base URLs (used to pick the address engines reach this rank at).
        """
        transport = choose_transport(
            self.args, self.device, previous=self.weight_updater.transport, adapter_config=self._adapter_config()
        )
        self.weight_updater.connect(transport, engines, engine_urls)

    def update_weights(self) -> None:
        """Push the current weights to every engine (paused meanwhile) under the next weight version."""
        if self.weight_updater is None:
            raise RuntimeError("only the actor syncs weights to the engines; the critic's value head is not an LM")
        if not self.weight_updater.engines:
            raise RuntimeError("update_weights before connect_rollout_engines: the actor has no engines to update")
        dtype = torch.bfloat16 if self.args.bf16 else None
        version = self.weight_updater.push(self._hf_weight_buckets(dtype))
        self.old_log_probs.after_push(self, version)
        if (self.weight_updater.check_first_push and version == 1) or self.args.check_lora_weight_equal:
            self.check_weights_equal()

    def check_weights_equal(self) -> dict[str, float]:
        """Compare each engine's log-probs of a probe sequence with this trainer's (every rank must call).

        Equality is checked through the model's output, since the CPU engine exposes no weights: the
        log-probs of a fixed probe sequence at temperature 1.

        Returns:
            {"max_abs_diff": largest gap over engines and tokens} (rank 0; 0.0 elsewhere).

        Raises:
            RuntimeError: on rank 0 when the gap exceeds `weight_sync.weight_check_tolerance()`.
        """
        probe = probe_tokens(self.vocab_size)
        trainer = self._forward_log_probs(self._probe_micro_batches(probe), 1, temperature=1.0)[0]
        if self.rank != 0:
            return {"max_abs_diff": 0.0}
        gap = self.weight_updater.check(probe, trainer)
        logger.info("weight check passed: max probe log-prob gap %.3g", gap)
        return {"max_abs_diff": gap}

    # ---- implemented by backends ---------------------------------------------------------------
    def _build(self, args, with_ref: bool) -> int:
        """Build model, optimizer and LR scheduler (`self.model`, `self.optimizer`, `self.lr_scheduler`,
        `self.device`, `self.dp_size`, `self.vocab_size`; `self.ref_weights` when `with_ref`), load weights
        and `--load`; return the rollout id to start from."""
        raise NotImplementedError

    def _micro_batches(self, data: dict) -> list[list]:
        """The shard's packed micro-batches, one list per optimizer step (`data["num_steps"]` of them)."""
        raise NotImplementedError

    def _forward_log_probs(self, steps: list[list], num_samples: int, temperature: float | None = None) -> list:
        """Per-sample response log-probs on CPU, no gradient (at the rollout temperature unless given)."""
        raise NotImplementedError

    def _forward_values(self, steps: list[list], num_samples: int) -> list:
        """Critic: per-sample values of the response tokens on CPU, no gradient."""
        raise NotImplementedError

    def _step_gradients(
        self, micro_batches: list, data: dict, loss_function: Callable, normalizer: StepNormalizer, fill: bool
    ) -> dict[str, float]:
        """Forward and backward over one step's micro-batches; return this rank's summed loss metrics.
        `fill` (only when `_can_fuse_old_log_probs`): store the forward's detached log-probs in data["log_probs"]."""
        raise NotImplementedError

    def _optimizer_step(self) -> float:
        """Clip and step the optimizer and LR scheduler unless the gradient norm is not finite; clear the
        gradients; return the norm."""
        raise NotImplementedError

    def _reset_optimizer_states(self) -> None:
        raise NotImplementedError("--reset-optimizer-states is not implemented by this backend")

    def _snapshot_weights(self, into: Weights | None = None) -> Weights:
        """CPU copies of this rank's weights (reusing the tensors of `into`)."""
        raise NotImplementedError

    def _load_weights(self, weights: Weights) -> None:
        """Copy a `_snapshot_weights` result back into the model."""
        raise NotImplementedError

    def _hf_weight_buckets(self, dtype: torch.dtype | None) -> Iterator[Bucket]:
        """What a weight update sends, in buckets of `--update-weight-buffer-size` (a collective: every rank
        iterates to the end): under LoRA only the adapter (PEFT saved names; the engines keep their base), else
        the model's weights under HF names."""
        if self.lora:
            return bucket_named_tensors(self._adapter_tensors(dtype), self.args.update_weight_buffer_size)
        return self._model_weight_buckets(dtype)

    def _model_weight_buckets(self, dtype: torch.dtype | None) -> Iterator[Bucket]:
        """The model's weights under HF names in buckets of `--update-weight-buffer-size` (a collective)."""
        raise NotImplementedError

    def _adapter_config(self) -> dict | None:
        """The LoRA adapter's PEFT config (`adapter_config.json`) when only an adapter is trained and pushed
        (`--lora-rank`), else None."""
        return None

    def _adapter_tensors(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the whole adapter as (PEFT saved name, full tensor), cast to `dtype` unless None. A collective
        over all training ranks (every rank iterates to the end); complete on rank 0, the rank that sends and
        writes it (other ranks may yield part of it, or nothing)."""
        raise NotImplementedError

    def _adapters_disabled(self) -> contextlib.AbstractContextManager:
        """LoRA: a context within which the model computes the base model's outputs (the reference)."""
        raise NotImplementedError

    def _probe_micro_batches(self, probe: list[int]) -> list[list]:
        """One step of one micro-batch holding the probe sequence (all but its first token scored)."""
        raise NotImplementedError

    def _save_checkpoint(self, root: str, rollout_id: int, update_tracker: bool) -> None:
        raise NotImplementedError

    def _save_hf(self, path: str) -> None:
        raise NotImplementedError

    def offload(self) -> int:
        """Free training memory while the engines generate (`--offload-train`); returns the bytes freed."""
        raise NotImplementedError

    def onload(self) -> None:
        """Undo `offload`."""
        raise NotImplementedError


def _shard_key(data: dict) -> tuple:
    """Identifies a rollout shard: its sample indices and response lengths."""
    return tuple(data.get("sample_indices", [])), tuple(data["response_lengths"])
