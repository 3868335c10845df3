"""RolloutManager: the Ray actor that owns the data source, the rollout and eval functions and the run context;
its EnginePool (slime/ray/engine_pool.py) owns the router and the engines.

`generate(rollout_id)` runs the rollout function, turns its samples into the train data dict,
splits it across data-parallel ranks and returns one object ref per rank.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import torch

from slime.algorithms.advantages import group_baseline_rewards
from slime.backends.sglang_utils.router import RouterHandle
from slime.observability.logging_utils import pop_logged_metrics
from slime.ray.engine_pool import EnginePool
from slime.ray.engine_pool import wait_for_external_engines as wait_for_external_engines  # its old home
from slime.ray.placement_group import PlacementSlice
from slime.rollout.base_types import RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.data_source import MultiLoraDataSource, compute_num_rollout
from slime.rollout.rm_hub import pop_reward_metrics, start_reward_workers
from slime.utils import progress as rollout_progress
from slime.utils.lora import adapter_metric_name, lora_adapter_count
from slime.utils.misc import load_function
from slime.utils.run_context import RunContext, expose_to_plugins
from slime.utils.seqlen_balancing import balanced_partitions
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """What `generate` hands the driver: one data ref per DP rank plus the rollout's metrics."""

    rollout_id: int
    data_refs: list[Any]
    metrics: dict[str, float] = field(default_factory=dict)


def post_process_rewards(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """(raw rewards, rewards to train on) of the samples: the user's `--custom-reward-post-process-path`
    f(args, samples) -> (raw_rewards, rewards), which may read dict rewards whole (`sample.get_reward_value(args)`
    without `--reward-key`), else each sample's scalar reward and the estimator's per-prompt baseline.

    Raises:
        ValueError: The post-process function did not return two lists of numbers, one per sample.
    """
    path = args.custom_reward_post_process_path
    if not path:
        raw_rewards = [s.get_reward_value(args.reward_key) for s in samples]
        return raw_rewards, group_baseline_rewards(args, raw_rewards)  # GRPO, RLOO, ...
    output = load_function(path)(args, samples)
    if not (isinstance(output, tuple | list) and len(output) == 2):
        raise ValueError(f"--custom-reward-post-process-path {path} must return (raw_rewards, rewards), got {output!r}")
    checked = []
    for name, values in zip(("raw_rewards", "rewards"), output, strict=True):
        try:
            numbers = [float(v) for v in values]  # plain, numpy or 0-d tensor numbers
        except (TypeError, ValueError):
            numbers = None
        if numbers is None or len(numbers) != len(samples):
            raise ValueError(
                f"--custom-reward-post-process-path {path} returned {name} {list(values)[:4]}...: it must hold one "
                f"number per sample ({len(samples)}); turn dict rewards into numbers there"
            )
        checked.append(numbers)
    return checked[0], checked[1]


def samples_to_train_data(
    args, samples: list[Sample], rewards: tuple[list[float], list[float]] | None = None
) -> dict[str, list]:
    """Flatten samples into the train data dict; rewards are normalized per the advantage estimator.

    Args:
        args: Parsed arguments (`advantage_estimator`, `n_samples_per_prompt`, `reward_key`, ...).
        samples: Samples in group order (`n_samples_per_prompt` consecutive samples per prompt).
        rewards: `post_process_rewards(args, samples)` when the caller has it already.

    Returns:
        dict with tokens, response_lengths, rewards, raw_reward, truncated, loss_masks,
        rollout_log_probs, rollout_routed_experts and teacher_log_probs (each when every sample has them),
        multimodal_train_inputs (when any sample has images; None for the others) and sample_indices. A sample with `remove_sample` set, or an `unfinished` one (aborted or failed, never
        scored; reward 0), keeps its place in its group but gets an all-zero loss mask.
    """
    raw_rewards, rewards = rewards if rewards is not None else post_process_rewards(args, samples)
    data: dict[str, list] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": rewards,
        "raw_reward": raw_rewards,
        "truncated": [int(s.status == Status.TRUNCATED) for s in samples],
        "loss_masks": [s.loss_mask if s.loss_mask is not None else [1] * s.response_length for s in samples],
        "sample_indices": [s.index for s in samples],
    }
    for i, (s, mask) in enumerate(zip(samples, data["loss_masks"], strict=True)):
        if len(mask) != s.response_length:
            raise ValueError(
                f"sample {s.index}: loss_mask has {len(mask)} entries for {s.response_length} response tokens"
            )
        if s.remove_sample or s.unfinished:
            data["loss_masks"][i] = [0] * s.response_length
    if all(s.rollout_log_probs is not None for s in samples):
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    if all(s.rollout_routed_experts is not None for s in samples):  # --use-rollout-routing-replay
        data["rollout_routed_experts"] = [s.rollout_routed_experts for s in samples]
    if all(s.teacher_log_probs is not None for s in samples):  # on-policy distillation (--use-opd)
        data["teacher_log_probs"] = [s.teacher_log_probs for s in samples]
    if any(s.multimodal_train_inputs for s in samples):  # vision-language: each sample's pixel_values, image grid
        data["multimodal_train_inputs"] = [s.multimodal_train_inputs for s in samples]
    if args.keep_old_actor:  # the trainer takes old log-probs from the weights that generated them
        data["weight_versions"] = [s.weight_versions[-1] if s.weight_versions else None for s in samples]
    if all(s.lora_adapter is not None for s in samples):  # --multi-lora-n-adapters: which adapter trains on each
        data["lora_adapters"] = [s.lora_adapter for s in samples]
    return data


# What the trainers need of a custom --custom-convert-samples-to-train-data-path result.
REQUIRED_TRAIN_DATA_KEYS = ("tokens", "response_lengths", "rewards", "loss_masks")


def convert_samples_to_train_data(
    args, samples: list[Sample], rewards: tuple[list[float], list[float]] | None = None
) -> dict[str, list]:
    """`samples_to_train_data` (given `rewards`, see there), or the user's
    `--custom-convert-samples-to-train-data-path` f(args, samples) -> dict.

    Raises:
        ValueError: The custom result is not a dict of per-sample lists with the keys the trainers need.
    """
    path = args.custom_convert_samples_to_train_data_path
    if not path:
        return samples_to_train_data(args, samples, rewards)
    data = load_function(path)(args, samples)
    if not isinstance(data, dict):
        raise ValueError(
            f"--custom-convert-samples-to-train-data-path {path} returned {type(data).__name__}, not a dict"
        )
    missing = [key for key in REQUIRED_TRAIN_DATA_KEYS if key not in data]
    if missing:
        raise ValueError(
            f"--custom-convert-samples-to-train-data-path {path} returned no {', '.join(missing)}; the trainers "
            f"need {', '.join(REQUIRED_TRAIN_DATA_KEYS)} (one entry per sample)"
        )
    lengths = {key: len(value) for key, value in data.items() if isinstance(value, list)}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"--custom-convert-samples-to-train-data-path {path} returned lists of different lengths {lengths}; "
            "every per-sample list must have one entry per sample"
        )
    return data


def pass_at_k(groups: list[list[float]]) -> dict[int, float]:
    """Unbiased pass@k over prompt groups (Chen et al., 2021), for every k from 1 to the smallest group's size.

    A sample passes when its reward is at least 1 (the built-in graders give 1 for a correct answer).

    Args:
        groups: The rewards of each prompt's samples.

    Returns:
        {k: mean over groups of 1 - C(n - c, k) / C(n, k)} with n samples and c passes in a group.
    """
    groups = [g for g in groups if g]
    if not groups:
        return {}
    smallest = min(len(g) for g in groups)
    passes = [(len(group), sum(r >= 1 for r in group)) for group in groups]
    return {
        k: sum(1.0 - math.comb(n - c, k) / math.comb(n, k) for n, c in passes) / len(passes)
        for k in range(1, smallest + 1)
    }


def reward_breakdown_metrics(
    args, groups: list[list[Sample]], reward_key: str | None, prefix: str, rewards: list[float] | None = None
) -> dict[str, float]:
    """The optional reward figures: `--log-passrate` (`<prefix>/pass@k`), `--log-reward-category`
    (`<prefix>/reward/<category>`), `--log-correct-samples` (response lengths of passing / failing samples).

    `rewards` are the scalar rewards of the groups' samples in order, when the caller has them (see
    `rollout_metrics`); otherwise they are read with `reward_key`.
    """
    samples = [s for group in groups for s in group]
    if not (args.log_passrate or args.log_reward_category or args.log_correct_samples):
        return {}
    if rewards is None:
        rewards = [s.get_reward_value(reward_key) for s in samples]
    metrics: dict[str, float] = {}
    if args.log_passrate:
        flat = iter(rewards)
        by_group = [[next(flat) for _ in group] for group in groups]
        metrics |= {f"{prefix}/pass@{k}": value for k, value in pass_at_k(by_group).items()}
    if args.log_reward_category:
        by_category: dict[str, list[float]] = {}
        for s, r in zip(samples, rewards, strict=True):
            category = str((s.metadata or {}).get(args.log_reward_category, "none"))
            by_category.setdefault(category, []).append(r)
        metrics |= {f"{prefix}/reward/{c}": sum(r) / len(r) for c, r in sorted(by_category.items())}
    if args.log_correct_samples:
        for name, passed in (("correct", True), ("incorrect", False)):
            lengths = [s.response_length for s, r in zip(samples, rewards, strict=True) if (r >= 1) == passed]
            if lengths:
                metrics[f"{prefix}/{name}_response_length"] = sum(lengths) / len(lengths)
    return metrics


def split_train_data_by_dp(args, data: dict[str, list], dp_size: int) -> list[dict[str, Any]]:
    """Give each data-parallel rank its share of every optimizer step's global batch.

    The rollout holds `num_steps_per_rollout` global batches back to back; within each, samples
    go to ranks round-robin, or token-balanced with `--balance-data`. With `--use-dynamic-global-batch-size` the
    rollout is one global batch of its own size, less the remainder past a multiple of `dp_size` (dropped from
    the end).
    """
    num_samples = len(data["tokens"])
    if args.use_dynamic_global_batch_size:
        num_samples -= num_samples % dp_size
        if num_samples == 0:
            raise ValueError(f"--use-dynamic-global-batch-size: {len(data['tokens'])} samples for {dp_size} ranks")
        global_batch_size = num_samples
    else:
        global_batch_size = args.global_batch_size
    if num_samples % global_batch_size or global_batch_size % dp_size:
        raise ValueError(
            f"{num_samples} samples do not split into global batches of --global-batch-size {global_batch_size} "
            f"over {dp_size} data-parallel ranks; a generate function that returns several samples per prompt "
            "(or none) needs --use-dynamic-global-batch-size"
        )
    rank_indices: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, num_samples, global_batch_size):
        step = list(range(start, start + global_batch_size))
        if args.balance_data:
            lengths = [len(data["tokens"][i]) for i in step]
            parts = [[step[j] for j in part] for part in balanced_partitions(lengths, dp_size)]
        else:
            parts = [step[r::dp_size] for r in range(dp_size)]
        for r in range(dp_size):
            rank_indices[r].extend(parts[r])
    per_rank = []
    for indices in rank_indices:
        shard = {key: [values[i] for i in indices] for key, values in data.items()}
        shard["num_steps"] = num_samples // global_batch_size
        per_rank.append(shard)
    return per_rank


def rollout_metrics(
    samples: list[Sample], reward_key: str | None, elapsed: float, rewards: list[float] | None = None
) -> dict[str, float]:
    """Reward, length, truncation and throughput figures of one rollout (`unfinished` samples count as reward 0).

    `rewards` are the samples' scalar rewards when the caller has them (after `--custom-reward-post-process-path`);
    otherwise they are read with `reward_key`.
    """
    if rewards is None:
        rewards = [s.get_reward_value(reward_key) for s in samples]
    lengths = [s.response_length for s in samples]
    n = max(len(samples), 1)
    return {
        "rollout/reward": sum(rewards) / n,
        "rollout/response_length": sum(lengths) / n,
        "rollout/response_length_max": float(max(lengths, default=0)),
        "rollout/truncated": sum(s.status == Status.TRUNCATED for s in samples) / n,
        "rollout/unfinished": sum(s.unfinished for s in samples) / n,
        "rollout/time": elapsed,
        "rollout/tokens_per_s": sum(lengths) / max(elapsed, 1e-9),
    }


def adapter_rollout_metrics(
    samples: list[Sample], reward_key: str | None, elapsed: float, rewards: list[float] | None = None
) -> dict[str, float]:
    """`rollout_metrics` of each adapter's samples (`--multi-lora-n-adapters`), as `rollout/adapter_<k>/<name>`
    (the rollout's time and throughput are the whole rollout's: left out)."""
    by_adapter: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        by_adapter.setdefault(sample.lora_adapter, []).append(i)
    metrics = {}
    for adapter, indices in sorted(by_adapter.items()):
        picked = None if rewards is None else [rewards[i] for i in indices]
        part = rollout_metrics([samples[i] for i in indices], reward_key, elapsed, picked)
        for name in ("rollout/time", "rollout/tokens_per_s"):
            del part[name]
        metrics |= {adapter_metric_name(name, adapter): value for name, value in part.items()}
    return metrics


def start_rollout(path: str, args, context: RunContext, data_source) -> Callable[..., Any]:
    """The `--rollout-function-path` (or `--eval-function-path`) target at `path`, ready to be called as
    `rollout(args, rollout_id, data_source, evaluation=False)`.

    A plain function is returned as is. A function with a `lifecycle` attribute (a class) has a life beyond each
    call: `lifecycle(args, context, data_source)` is built once and returned, and the manager calls what it
    defines of these:

    - `generates_in_background` (bool): it generates between calls (the driver asks for each batch only when it
      trains on it);
    - `on_weights_updated(version)`: the trainer pushed weights `version`;
    - `save(rollout_id)`: save the data source for checkpoint `rollout_id` in its stead;
    - `close()`: stop whatever it runs (on dispose).
    """
    fn = load_function(path)
    lifecycle = getattr(fn, "lifecycle", None)
    return fn if lifecycle is None else lifecycle(args, context, data_source)


class RolloutManager:
    """Owns the data source, the rollout and eval functions and the run context; the router and engines are its
    `EnginePool`'s. Created as a Ray actor by `create_rollout_manager`."""

    def __init__(self, args, rollout_slice: PlacementSlice | None):
        self.args = args
        self.engine_pool = EnginePool(args, rollout_slice, on_engine_restarted=self._expose_context)
        self.state_before_rollout: tuple[int, dict] | None = None  # (rollout id, data source state)
        self.trainer_weight_version: int | None = None
        if not args.debug_train_only:
            self.engine_pool.start_in_background()  # whatever needs the engines waits for them (`wait_for_engines`)
            start_reward_workers(args)  # in the background too
        # --multi-lora-n-adapters: one prompt stream per adapter (validation keeps --data-source-path the default)
        multi_lora = lora_adapter_count(args) > 1
        self.data_source = MultiLoraDataSource(args) if multi_lora else load_function(args.data_source_path)(args)
        # --num-rollout wins over --num-epoch (validation warns of both).
        num_rollout = (
            args.num_rollout if args.num_rollout is not None else compute_num_rollout(args, len(self.data_source))
        )
        self.context = RunContext(
            num_rollout=num_rollout,
            engine_urls_source=lambda: self.engine_pool.engine_urls,
            weight_version_source=lambda: self.trainer_weight_version,
        )
        self._expose_context()
        # Started once the engines are up (the context then knows the router): `wait_for_engines`.
        self.rollout_fn = self.eval_fn = None

    def _expose_context(self) -> None:
        expose_to_plugins(self.args, self.context)

    @property
    def router(self) -> RouterHandle | None:
        """The router's handle (None before the engines are up, or without engines)."""
        return self.engine_pool.router

    # ---- engines -------------------------------------------------------------------------
    def wait_for_engines(self) -> None:
        """Block until router and engines are up, then start the rollout functions; re-raises the error that
        stopped the engines from starting."""
        self.engine_pool.wait()
        if self.rollout_fn is not None:
            return
        host, port = self.engine_pool.router_address()
        self.context = replace(self.context, router_host=host, router_port=port)
        self._expose_context()
        args = self.args
        self.rollout_fn = start_rollout(args.rollout_function_path, args, self.context, self.data_source)
        self.eval_fn = (
            self.rollout_fn
            if args.eval_function_path == args.rollout_function_path
            else start_rollout(args.eval_function_path, args, self.context, self.data_source)
        )

    def get_engines(self) -> list:
        self.wait_for_engines()
        return self.engine_pool.engines

    def get_engine_urls(self) -> list[str]:
        self.wait_for_engines()
        return self.engine_pool.engine_urls

    def get_num_rollout(self) -> tuple[int, int]:
        """(total rollouts of the run, rollouts per epoch); `--num-epoch` resolves against the dataset size."""
        per_epoch = max(len(self.data_source) // self.args.rollout_batch_size, 1)
        return self.context.num_rollout, per_epoch

    def dead_engines(self) -> list[int]:
        """Indices of engines whose server process has exited or no longer answers GET /health."""
        return self.engine_pool.dead_engines()

    def replace_dead_engines(self, what: str) -> list[int]:
        """After the driver's step `what` failed: restart dead engines (`--use-fault-tolerance`) or raise naming them;
        returns the engines awaiting the current weights, [] when none died (see EnginePool)."""
        return self.engine_pool.replace_dead_engines(what)

    def engines_awaiting_weights(self, timeout: float | None = None) -> list[int]:
        """Indices of engines restarted by `--use-fault-tolerance` that need the current weights (see EnginePool)."""
        return self.engine_pool.engines_awaiting_weights(timeout)

    def readmit_engines(self, indices: list[int]) -> None:
        """Put restarted engines, which now hold the current weights, back into the router."""
        self.engine_pool.readmit(indices)

    def _call_rollout_fn(self, fn, rollout_id: int, evaluation: bool, args=None, data_source=None):
        """`call_rollout_fn` on the manager's data source (or `data_source`, with `args`); a failure the engines
        explain is reported as theirs."""
        args = self.args if args is None else args
        data_source = self.data_source if data_source is None else data_source
        try:
            output = call_rollout_fn(fn, args, rollout_id, data_source, evaluation=evaluation)
        except Exception as e:
            problem = self.engine_pool.serving_problem(rollout_id)
            if problem:
                raise RuntimeError(f"{problem} (the rollout failed with {type(e).__name__}: {e})") from e
            raise
        self.engine_pool.check_after_rollout(rollout_id)
        return output

    # ---- rollout -------------------------------------------------------------------------
    def generate(self, rollout_id: int, dp_size: int = 1) -> RolloutBatch:
        """Run one training rollout and return per-rank train data refs and metrics."""
        self.wait_for_engines()
        started = time.time()
        # A rollout generating in the background draws from the data source on its own thread: it saves it itself.
        if hasattr(self.data_source, "state_dict") and not self.generates_in_background():
            self.state_before_rollout = (rollout_id, copy.deepcopy(self.data_source.state_dict()))
        args = self.args
        if args.load_debug_rollout_data:
            samples, extra_metrics = self._load_debug_rollout_data(rollout_id), {}
            n = args.n_samples_per_prompt
            groups = [samples[i : i + n] for i in range(0, len(samples), n)]
        else:
            output = self._train_rollout(rollout_id)
            groups, extra_metrics = output.samples, dict(output.metrics or {})
            groups = [group if isinstance(group, list) else [group] for group in groups]
            samples = [s for group in groups for s in group]
        elapsed = time.time() - started
        if args.save_debug_rollout_data:
            self._save_debug_rollout_data(rollout_id, samples)

        # A --custom-reward-post-process-path function may turn dict rewards into numbers: it runs first and the
        # figures below report its raw rewards (a custom train data conversion does its own reward processing).
        rewards = (
            post_process_rewards(args, samples)
            if args.custom_reward_post_process_path and not args.custom_convert_samples_to_train_data_path
            else None
        )
        raw_rewards = rewards[0] if rewards is not None else None
        log_function = args.custom_rollout_log_function_path
        # The user's f(rollout_id, args, samples, extra_metrics, rollout_time) -> True replaces the default figures.
        if log_function and load_function(log_function)(rollout_id, args, samples, extra_metrics, elapsed):
            metrics = dict(extra_metrics)
        else:
            metrics = {**rollout_metrics(samples, args.reward_key, elapsed, raw_rewards), **extra_metrics}
            metrics |= reward_breakdown_metrics(args, groups, args.reward_key, "rollout", raw_rewards)
            if isinstance(self.data_source, MultiLoraDataSource):
                metrics |= adapter_rollout_metrics(samples, args.reward_key, elapsed, raw_rewards)
        # What plugins logged with slime.observability.logging_utils.log during this rollout joins its row.
        metrics |= pop_reward_metrics() | self.engine_pool.metrics() | pop_logged_metrics()
        if args.debug_rollout_only:
            return RolloutBatch(rollout_id, [], metrics)
        data = convert_samples_to_train_data(args, samples, rewards)
        shards = split_train_data_by_dp(args, data, dp_size)
        if args.use_dynamic_global_batch_size:
            metrics["rollout/dropped_samples"] = len(data["tokens"]) % dp_size  # past the last multiple of the DP size
        if args.save_debug_train_data:
            self._save_debug_train_data(rollout_id, shards)
        return RolloutBatch(rollout_id, [ray.put(shard) for shard in shards], metrics)

    def _train_rollout(self, rollout_id: int) -> RolloutFnTrainOutput:
        """The rollout function's training output. With several LoRA adapters it runs once per adapter, on that
        adapter's prompts and with its reward, so that every adapter gets its full batch whatever the dynamic filter
        drops or the engines abort; the adapters' groups follow one another (each fills whole global batches) and
        the function's own figures come per adapter."""
        if not isinstance(self.data_source, MultiLoraDataSource):
            return self._call_rollout_fn(self.rollout_fn, rollout_id, evaluation=False)
        groups, metrics = [], {}
        for adapter, source in enumerate(self.data_source.sources):
            args = self.data_source.rollout_args(self.args, adapter)
            output = self._call_rollout_fn(self.rollout_fn, rollout_id, False, args, source)
            groups += output.samples
            metrics |= {adapter_metric_name(name, adapter): value for name, value in (output.metrics or {}).items()}
        return RolloutFnTrainOutput(samples=groups, metrics=metrics)

    @ray.method(concurrency_group="progress")
    def progress(self) -> list[rollout_progress.ProgressState]:
        """The progress bars of the rollouts in this process (`slime.utils.progress.snapshot`); in its own concurrency
        group, so it answers while `generate` or `eval` runs (the driver draws them: slime/ray/progress.py)."""
        return rollout_progress.snapshot()

    def generates_in_background(self) -> bool:
        """True when the rollout function generates between calls (the fully async rollout): the driver then asks
        for each batch only when it is about to train on it."""
        self.wait_for_engines()
        return bool(getattr(self.rollout_fn, "generates_in_background", False))

    def set_trainer_weight_version(self, version: int) -> None:
        """Record the weight version the trainer trains from (the driver calls it after each push; the run context
        gives it) and tell the rollout functions that follow pushes (`on_weights_updated`)."""
        self.trainer_weight_version = version
        for fn in self._started_rollouts():
            if hasattr(fn, "on_weights_updated"):
                fn.on_weights_updated(version)

    def _started_rollouts(self) -> list:
        """The rollout and eval functions started so far, each once."""
        started = [self.rollout_fn] + ([self.eval_fn] if self.eval_fn is not self.rollout_fn else [])
        return [fn for fn in started if fn is not None]

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Run every eval set; returns `eval/<name>` mean reward and truncation rate."""
        self.wait_for_engines()
        if not (self.args.eval_prompt_data or self.args.eval_config):
            return {}
        output = self._call_rollout_fn(self.eval_fn, rollout_id, evaluation=True)
        data, metrics = output.data, dict(output.metrics or {})
        if self.args.save_debug_rollout_data:
            self._save_debug_eval_data(rollout_id, data)
        log_function = self.args.custom_eval_rollout_log_function_path
        # The user's f(rollout_id, args, data, extra_metrics) -> True replaces the default eval figures.
        if log_function and load_function(log_function)(rollout_id, self.args, data, metrics):
            return metrics | pop_logged_metrics()
        reward_key = self.args.eval_reward_key or self.args.reward_key
        for name, result in data.items():
            rewards = result["rewards"]
            metrics[f"eval/{name}"] = sum(rewards) / max(len(rewards), 1)
            metrics[f"eval/{name}/truncated"] = sum(result["truncated"]) / max(len(rewards), 1)
            # Each prompt's samples form a group (datasets of an --eval-config may take different counts).
            groups: dict[int, list[Sample]] = {}
            for sample in result.get("samples") or []:
                groups.setdefault(sample.group_index, []).append(sample)
            groups = list(groups.values())
            metrics |= reward_breakdown_metrics(self.args, groups, reward_key, f"eval/{name}")
        return metrics

    # ---- debug data ----------------------------------------------------------------------
    def _save_debug_rollout_data(self, rollout_id: int, samples: list[Sample]) -> None:
        path = self.args.save_debug_rollout_data.format(rollout_id=rollout_id)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in samples]}, path)
        logger.info("saved rollout %d samples to %s", rollout_id, path)

    def _save_debug_eval_data(self, rollout_id: int, data: dict[str, dict]) -> None:
        """Each eval set's samples with their rewards, beside the rollout dumps: `eval_<set>_<rollout file name>`."""
        path = Path(self.args.save_debug_rollout_data.format(rollout_id=rollout_id))
        path.parent.mkdir(parents=True, exist_ok=True)
        for name, result in data.items():
            samples = [s.to_dict() for s in result.get("samples") or []]
            target = path.with_name(f"eval_{name.replace(os.sep, '_')}_{path.name}")
            torch.save({"rollout_id": rollout_id, "eval_set": name, "samples": samples}, target)
            logger.info("saved eval %s of rollout %d (%d samples) to %s", name, rollout_id, len(samples), target)

    def _load_debug_rollout_data(self, rollout_id: int) -> list[Sample]:
        """The saved samples of `rollout_id`; `--load-debug-rollout-data-subsample F` keeps the first fraction F of
        them, whole prompt groups and whole global batches."""
        path = self.args.load_debug_rollout_data.format(rollout_id=rollout_id)
        if not os.path.exists(path):
            raise FileNotFoundError(f"--load-debug-rollout-data: no file {path} for rollout {rollout_id}")
        samples = [Sample.from_dict(d) for d in torch.load(path, weights_only=True)["samples"]]
        fraction = self.args.load_debug_rollout_data_subsample
        if fraction is not None:
            unit = math.lcm(self.args.n_samples_per_prompt, self.args.global_batch_size)
            keep = int(len(samples) * fraction) // unit * unit
            if keep == 0:
                raise ValueError(
                    f"--load-debug-rollout-data-subsample {fraction} keeps {int(len(samples) * fraction)} of the "
                    f"{len(samples)} samples in {path}, less than {unit} (whole prompt groups making whole global "
                    "batches); raise it"
                )
            samples = samples[:keep]
        return samples

    def _save_debug_train_data(self, rollout_id: int, shards: list[dict[str, Any]]) -> None:
        """--save-debug-train-data: each data-parallel rank's train data, as its trainer receives it."""
        for rank, shard in enumerate(shards):
            path = self.args.save_debug_train_data.format(rollout_id=rollout_id, rank=rank)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save({"rollout_id": rollout_id, "rank": rank, "data": shard}, path)
        logger.info("saved rollout %d train data of %d ranks", rollout_id, len(shards))

    # ---- checkpoint & memory -------------------------------------------------------------
    def save(self, rollout_id: int) -> None:
        """Save the data source as it stood when rollout `rollout_id` was complete.

        train_async.py draws rollout k+1 before it saves step k, so the state from before that
        draw is saved then; a resumed run redraws rollout k+1's prompts. A rollout function with a `save`
        (the fully async one: its groups not handed to the trainer yet go into the checkpoint as fresh prompts)
        saves the data source itself.
        """
        self.wait_for_engines()
        if hasattr(self.rollout_fn, "save"):
            self.rollout_fn.save(rollout_id)
            return
        drawn_next = self.state_before_rollout is not None and self.state_before_rollout[0] == rollout_id + 1
        if not drawn_next:
            self.data_source.save(rollout_id)
            return
        current = copy.deepcopy(self.data_source.state_dict())
        self.data_source.load_state_dict(self.state_before_rollout[1])
        try:
            self.data_source.save(rollout_id)
        finally:
            self.data_source.load_state_dict(current)

    def load(self, rollout_id: int | None = None) -> None:
        self.data_source.load(rollout_id)

    def offload(self) -> dict[str, float]:
        """Release the engines' memory; returns what they report holding afterwards (see `EnginePool.offload`)."""
        self.wait_for_engines()
        return self.engine_pool.offload()

    def onload(self) -> dict[str, float]:
        self.wait_for_engines()
        return self.engine_pool.onload()

    def dispose(self) -> None:
        """Close the rollout functions (a background loop stops), then the engines and router; leaves no process
        behind."""
        with contextlib.suppress(Exception):  # a failed start has cleaned up after itself
            self.engine_pool.wait()
        for fn in self._started_rollouts():
            if hasattr(fn, "close"):
                fn.close()
        self.engine_pool.dispose()


def create_rollout_manager(args, rollout_slice: PlacementSlice, wait_for_engines: bool = True):
    """Start the RolloutManager actor (it uses no bundle itself); with `wait_for_engines`, return once its engines
    are up, else at once (its engine-using methods wait for them)."""
    manager = ray.remote(num_cpus=0, concurrency_groups={"progress": 1})(RolloutManager).remote(args, rollout_slice)
    if wait_for_engines:
        ray.get(manager.wait_for_engines.remote())
    return manager
