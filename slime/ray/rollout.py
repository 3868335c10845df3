"""RolloutManager: the Ray actor that owns the router, the engines, the data source and the rollout function.

`generate(rollout_id)` runs the rollout function, turns its samples into the train data dict,
splits it across data-parallel ranks and returns one object ref per rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import ray
import torch

from slime.algorithms.advantages import group_baseline_rewards
from slime.backends.sglang_utils.engine_actor import RolloutEngine
from slime.backends.sglang_utils.engine_command_line import engine_api_key
from slime.backends.sglang_utils.http_client import EngineClient
from slime.backends.sglang_utils.router import (
    add_worker,
    remove_worker,
    router_is_healthy,
    start_router,
    wait_for_workers,
)
from slime.ray.engine_health import EngineHealthMonitor
from slime.ray.placement_group import PlacementSlice
from slime.rollout import fully_async_rollout
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.data_source import compute_num_rollout
from slime.rollout.rm_hub import pop_reward_metrics
from slime.utils import progress as rollout_progress
from slime.utils.http_utils import wait_until_healthy
from slime.utils.misc import load_function
from slime.utils.seqlen_balancing import balanced_partitions
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """What `generate` hands the driver: one data ref per DP rank plus the rollout's metrics."""

    rollout_id: int
    data_refs: list[Any]
    metrics: dict[str, float] = field(default_factory=dict)


def samples_to_train_data(args, samples: list[Sample]) -> dict[str, list]:
    """Flatten samples into the train data dict; rewards are normalized per the advantage estimator.

    Args:
        args: Parsed arguments (`advantage_estimator`, `n_samples_per_prompt`, `reward_key`, ...).
        samples: Samples in group order (`n_samples_per_prompt` consecutive samples per prompt).

    Returns:
        dict with tokens, response_lengths, rewards, raw_reward, truncated, loss_masks,
        rollout_log_probs, rollout_routed_experts and teacher_log_probs (each when every sample has them) and
        sample_indices. A sample with `remove_sample` set, or an `unfinished` one (aborted or failed, never
        scored; reward 0), keeps its place in its group but gets an all-zero loss mask.
    """
    if args.custom_reward_post_process_path:
        raw_rewards, rewards = load_function(args.custom_reward_post_process_path)(args, samples)
    else:
        raw_rewards = [s.get_reward_value(args.reward_key) for s in samples]
        rewards = group_baseline_rewards(args, raw_rewards)  # the estimator's per-prompt baseline (GRPO, RLOO, ...)

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
    if getattr(args, "keep_old_actor", False):  # the trainer takes old log-probs from the weights that generated them
        data["weight_versions"] = [s.weight_versions[-1] if s.weight_versions else None for s in samples]
    return data


# What the trainers need of a custom --custom-convert-samples-to-train-data-path result.
REQUIRED_TRAIN_DATA_KEYS = ("tokens", "response_lengths", "rewards", "loss_masks")


def convert_samples_to_train_data(args, samples: list[Sample]) -> dict[str, list]:
    """`samples_to_train_data`, or the user's `--custom-convert-samples-to-train-data-path` f(args, samples) -> dict.

    Raises:
        ValueError: The custom result is not a dict of per-sample lists with the keys the trainers need.
    """
    path = args.custom_convert_samples_to_train_data_path
    if not path:
        return samples_to_train_data(args, samples)
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


def reward_breakdown_metrics(args, groups: list[list[Sample]], reward_key: str | None, prefix: str) -> dict[str, float]:
    """The optional reward figures: `--log-passrate` (`<prefix>/pass@k`), `--log-reward-category`
    (`<prefix>/reward/<category>`), `--log-correct-samples` (response lengths of passing / failing samples)."""
    metrics: dict[str, float] = {}
    if args.log_passrate:
        rewards = [[s.get_reward_value(reward_key) for s in group] for group in groups]
        metrics |= {f"{prefix}/pass@{k}": value for k, value in pass_at_k(rewards).items()}
    samples = [s for group in groups for s in group]
    if args.log_reward_category:
        by_category: dict[str, list[float]] = {}
        for s in samples:
            category = str((s.metadata or {}).get(args.log_reward_category, "none"))
            by_category.setdefault(category, []).append(s.get_reward_value(reward_key))
        metrics |= {f"{prefix}/reward/{c}": sum(r) / len(r) for c, r in sorted(by_category.items())}
    if args.log_correct_samples:
        for name, passed in (("correct", True), ("incorrect", False)):
            lengths = [s.response_length for s in samples if (s.get_reward_value(reward_key) >= 1) == passed]
            if lengths:
                metrics[f"{prefix}/{name}_response_length"] = sum(lengths) / len(lengths)
    return metrics


def split_train_data_by_dp(args, data: dict[str, list], dp_size: int) -> list[dict[str, Any]]:
    """Give each data-parallel rank its share of every optimizer step's global batch.

    The rollout holds `num_steps_per_rollout` global batches back to back; within each, samples
    go to ranks round-robin, or token-balanced with `--balance-data`.
    """
    num_samples = len(data["tokens"])
    global_batch_size = args.global_batch_size
    if num_samples % global_batch_size or global_batch_size % dp_size:
        raise ValueError(
            f"{num_samples} samples do not split into global batches of --global-batch-size {global_batch_size} "
            f"over {dp_size} data-parallel ranks"
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
        shard["total_response_tokens"] = sum(data["response_lengths"])
        per_rank.append(shard)
    return per_rank


def rollout_metrics(samples: list[Sample], reward_key: str | None, elapsed: float) -> dict[str, float]:
    """Reward, length, truncation and throughput figures of one rollout (`unfinished` samples count as reward 0)."""
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


class RolloutManager:
    """Owns router, engines, data source and rollout function. Created as a Ray actor by `create_rollout_manager`."""

    def __init__(self, args, rollout_slice: PlacementSlice):
        self.args = args
        self.router = None
        self.engines: list = []
        self.engine_urls: list[str] = []
        self.state_before_rollout: tuple[int, dict] | None = None  # (rollout id, data source state)
        # --use-fault-tolerance: engines being restarted, restarted ones not yet given the current weights.
        self.monitor: EngineHealthMonitor | None = None
        self.num_engine_restarts = 0
        self._recovering: set[int] = set()
        self._awaiting_weights: set[int] = set()
        self._restarted_at: dict[int, float] = {}
        self._recovery_changed = threading.Condition()
        self._engines_started: concurrent.futures.Future | None = None
        if not args.debug_train_only:
            # Router and engines come up on a thread while the driver builds the trainers: the two are most of a
            # run's start-up. Whatever needs the engines waits for them (`wait_for_engines`).
            starter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="start-engines")
            self._engines_started = starter.submit(self._start_engines, rollout_slice)
            starter.shutdown(wait=False)
        self.data_source = load_function(args.data_source_path)(args)
        if args.num_rollout is None:
            args.num_rollout = compute_num_rollout(args, len(self.data_source))
        self.rollout_fn = load_function(args.rollout_function_path)
        self.eval_fn = load_function(args.eval_function_path)

    # ---- engines -------------------------------------------------------------------------
    def _start_engines(self, rollout_slice: PlacementSlice) -> None:
        args = self.args
        self.router = start_router(args)
        router_address = urlparse(self.router.url)
        args.sglang_router_ip, args.sglang_router_port = router_address.hostname, router_address.port
        per_engine = args.rollout_num_gpus_per_engine
        num_engines = max(1, len(rollout_slice) // per_engine)
        self.rollout_slice = rollout_slice
        external = args.rollout_external_engine_addrs
        # Engines the user started are only routed to and given weights, through plain clients.
        if external:
            self.engines = [self._engine_client(url) for url in external]
        else:
            self.engines = [self._create_engine(rank) for rank in range(num_engines)]
        try:
            if external:
                self.engine_urls = wait_for_external_engines(external, args.rollout_engine_start_timeout)
            else:
                self.engine_urls = ray.get(
                    [engine.start.remote(timeout=args.rollout_engine_start_timeout) for engine in self.engines]
                )
            for url in self.engine_urls:
                add_worker(self.router.url, url, api_key=engine_api_key(args))
            wait_for_workers(self.router.url, self.engine_urls, timeout=args.rollout_engine_start_timeout)
        except Exception:
            self.dispose()
            raise
        args.rollout_engine_urls = self.engine_urls
        logger.info("router %s with engines %s", self.router.url, self.engine_urls)
        if args.use_fault_tolerance:
            self.monitor = EngineHealthMonitor(
                lambda: [self._engine_client(url) for url in self.engine_urls],
                self._recover_engine,
                interval=args.rollout_health_check_interval,
                timeout=args.rollout_health_check_timeout,
                first_wait=args.rollout_health_check_first_wait,
            )
            self.monitor.start()

    def _create_engine(self, rank: int):
        """A RolloutEngine actor for engine `rank`, pinned to that engine's first bundle."""
        args, rollout_slice = self.args, self.rollout_slice
        per_engine = args.rollout_num_gpus_per_engine
        # Colocated engines share each bundle with a trainer rank, so each takes a fraction of it.
        share = 0.2 if args.colocate else 1.0
        options: dict[str, Any] = {"num_cpus": share}
        # 127.0.0.1, or its node's IP on a multi-node cluster: the router and the trainer reach it there.
        kwargs: dict[str, Any] = {"backend": args.rollout_backend, "host": rollout_slice.host(rank * per_engine)}
        if rollout_slice.use_gpu:
            options |= {
                "num_gpus": share,
                "runtime_env": {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
            }
            kwargs["base_gpu_id"] = rollout_slice.gpu_ids[rank * per_engine]
        if rollout_slice.pg is not None:
            options["scheduling_strategy"] = rollout_slice.strategy(rank * per_engine)
        return ray.remote(RolloutEngine).options(**options).remote(args, rank, **kwargs)

    def _engine_client(self, url: str) -> EngineClient:
        return EngineClient(url, api_key=engine_api_key(self.args))

    # ---- fault tolerance -----------------------------------------------------------------
    def _recover_engine(self, index: int, reason: str, probe_started: float = float("inf")) -> None:
        """Take a failed engine out of the router and restart it on its own bundle (monitor thread).

        The restarted engine still serves the checkpoint's weights, so it only goes back into the
        router in `readmit_engines`, after the trainer has pushed the current weights to it.
        """
        with self._recovery_changed:
            # The monitor thread and probe_now may both report one failure; a probe older than the last
            # restart of this engine says nothing about the restarted one.
            if index in self._recovering or probe_started < self._restarted_at.get(index, float("-inf")):
                return
            self._recovering.add(index)
        url = self.engine_urls[index]
        try:
            logger.warning("engine %d (%s) failed (%s): restarting it", index, url, reason)
            with contextlib.suppress(ValueError):  # not registered (yet): nothing to remove
                remove_worker(self.router.url, url)
            engine = self.engines[index]
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception:  # the actor itself is gone or stuck: replace it on the same bundle
                ray.kill(engine, no_restart=True)
                engine = self._create_engine(index)
            new_url = ray.get(engine.start.remote(timeout=self.args.rollout_engine_start_timeout))
            self.engines[index], self.engine_urls[index] = engine, new_url
            self.args.rollout_engine_urls = self.engine_urls
            with self._recovery_changed:
                self._awaiting_weights.add(index)
                self.num_engine_restarts += 1
                self._restarted_at[index] = time.monotonic()
            logger.warning(
                "engine %d restarted at %s; it rejoins the router after the next weight push", index, new_url
            )
        finally:
            with self._recovery_changed:
                self._recovering.discard(index)
                self._recovery_changed.notify_all()

    def engines_awaiting_weights(self, timeout: float | None = None) -> list[int]:
        """Indices of restarted engines that need the current weights, once running restarts are done.

        Raises:
            TimeoutError: A restart is still running after `timeout` seconds.
        """
        timeout = self.args.rollout_engine_start_timeout + 120 if timeout is None else timeout
        with self._recovery_changed:
            if not self._recovery_changed.wait_for(lambda: not self._recovering, timeout=timeout):
                raise TimeoutError(f"engines {sorted(self._recovering)} are still restarting after {timeout:.0f} s")
            return sorted(self._awaiting_weights)

    def readmit_engines(self, indices: list[int]) -> None:
        """Put restarted engines, which now hold the current weights, back into the router."""
        urls = [self.engine_urls[i] for i in indices]
        for url in urls:
            add_worker(self.router.url, url, api_key=engine_api_key(self.args))
        wait_for_workers(self.router.url, urls, timeout=self.args.rollout_engine_start_timeout)
        with self._recovery_changed:
            self._awaiting_weights -= set(indices)
        logger.info("engines %s are back in the router", urls)

    def wait_for_engines(self) -> None:
        """Block until router and engines are up; re-raises the error that stopped them from starting."""
        if self._engines_started is not None:
            self._engines_started.result()

    def get_engines(self) -> list:
        self.wait_for_engines()
        return self.engines

    def get_engine_urls(self) -> list[str]:
        self.wait_for_engines()
        return self.engine_urls

    def get_num_rollout(self) -> tuple[int, int]:
        """(total rollouts of the run, rollouts per epoch); `--num-epoch` resolves against the dataset size."""
        per_epoch = max(len(self.data_source) // self.args.rollout_batch_size, 1)
        return self.args.num_rollout, per_epoch

    def dead_engines(self) -> list[int]:
        """Indices of engines whose server process has exited or no longer answers GET /health."""
        dead = []
        for index, engine in enumerate(self.engines):
            try:
                # An external engine has no process here to watch: its /health below is all there is.
                alive = bool(self.args.rollout_external_engine_addrs) or ray.get(engine.is_alive.remote(), timeout=30)
            except Exception:  # the actor itself is gone
                alive = False
            # The process check alone can lag a SIGKILL (or watch a launcher whose server child died); an
            # engine that cannot answer /health would fail the next weight push, so it counts as dead too.
            if not alive or not self._engine_client(self.engine_urls[index]).health(timeout=10):
                dead.append(index)
        return dead

    def _call_rollout_fn(self, fn, rollout_id: int, evaluation: bool):
        try:
            output = fn(self.args, rollout_id, self.data_source, evaluation=evaluation)
        except Exception as e:
            problem = self._serving_problem(rollout_id)
            if problem:
                raise RuntimeError(f"{problem} (the rollout failed with {type(e).__name__}: {e})") from e
            raise
        if self.monitor is not None:
            # An engine may have died after the monitor's last round (the rollout finished on the others):
            # probe now, then let restarts finish, so offloading and the next weight push see every engine.
            self.monitor.probe_now()
            self.engines_awaiting_weights()
            return output
        # The router may have retried a dead engine's requests elsewhere; the run still cannot go on without it
        # (weight updates would miss it), so a death is an error even when the rollout itself succeeded.
        problem = self._serving_problem(rollout_id)
        if problem:
            raise RuntimeError(problem)
        return output

    def _serving_problem(self, rollout_id: int) -> str | None:
        """What stops the engines from serving: a dead router or dead engines (None when all is well)."""
        if self.router is not None and not router_is_healthy(self.router):
            return (
                f"rollout {rollout_id}: {self.router.describe_failure()}; resume from the last checkpoint with --load"
            )
        dead = self.dead_engines() if self.engines else []
        if not dead:
            return None
        names = ", ".join(f"engine {i} ({self.engine_urls[i]})" for i in dead)
        fix = (
            "they could not be restarted in time"
            if self.monitor is not None
            else "pass --use-fault-tolerance to restart dead engines and go on"
        )
        return f"rollout {rollout_id}: inference {names} died; {fix}. Check the engine logs (in $TMPDIR/slime_logs) and resume from the last checkpoint with --load"

    # ---- rollout -------------------------------------------------------------------------
    def generate(self, rollout_id: int, dp_size: int = 1) -> RolloutBatch:
        """Run one training rollout and return per-rank train data refs and metrics."""
        self.wait_for_engines()
        started = time.time()
        # A fully async rollout's loop draws from the data source on its own thread meanwhile: `save` asks it instead.
        if hasattr(self.data_source, "state_dict") and fully_async_rollout.current_worker() is None:
            self.state_before_rollout = (rollout_id, copy.deepcopy(self.data_source.state_dict()))
        args = self.args
        if args.load_debug_rollout_data:
            samples, extra_metrics = self._load_debug_rollout_data(rollout_id), {}
            n = args.n_samples_per_prompt
            groups = [samples[i : i + n] for i in range(0, len(samples), n)]
        else:
            output = self._call_rollout_fn(self.rollout_fn, rollout_id, evaluation=False)
            if isinstance(output, RolloutFnTrainOutput):
                groups, extra_metrics = output.samples, output.metrics
            else:
                groups, extra_metrics = output, {}
            groups = [group if isinstance(group, list) else [group] for group in groups]
            samples = [s for group in groups for s in group]
        elapsed = time.time() - started
        if args.save_debug_rollout_data:
            self._save_debug_rollout_data(rollout_id, samples)

        log_function = args.custom_rollout_log_function_path
        # The user's f(rollout_id, args, samples, extra_metrics, rollout_time) -> True replaces the default figures.
        if log_function and load_function(log_function)(rollout_id, args, samples, extra_metrics, elapsed):
            metrics = dict(extra_metrics)
        else:
            metrics = {**rollout_metrics(samples, args.reward_key, elapsed), **extra_metrics}
            metrics |= reward_breakdown_metrics(args, groups, args.reward_key, "rollout")
        metrics |= pop_reward_metrics()
        if self.monitor is not None:
            metrics["rollout/engine_restarts"] = self.num_engine_restarts
        if self.engines and not args.rollout_external_engine_addrs:  # not measurable from here for external ones
            metrics["perf/engine_peak_memory_gb"] = max(ray.get([e.peak_memory_gb.remote() for e in self.engines]))
        if args.debug_rollout_only:
            return RolloutBatch(rollout_id, [], metrics)
        data = convert_samples_to_train_data(args, samples)
        shards = split_train_data_by_dp(args, data, dp_size)
        if args.save_debug_train_data:
            self._save_debug_train_data(rollout_id, shards)
        return RolloutBatch(rollout_id, [ray.put(shard) for shard in shards], metrics)

    @ray.method(concurrency_group="progress")
    def progress(self) -> list[rollout_progress.ProgressState]:
        """The progress bars of the rollouts in this process (`slime.utils.progress.snapshot`); in its own concurrency
        group, so it answers while `generate` or `eval` runs (the driver draws them: slime/ray/progress.py)."""
        return rollout_progress.snapshot()

    def generates_in_background(self) -> bool:
        """True once the rollout function runs a background generation loop (the fully async rollout): the
        driver then asks for each batch only when it is about to train on it."""
        return fully_async_rollout.current_worker() is not None

    def set_trainer_weight_version(self, version: int) -> None:
        """Tell the rollout function the weight version the trainer trains from (the driver calls it after each
        push); the fully async rollout measures staleness against it (`args.trainer_weight_version`)."""
        fully_async_rollout.set_trainer_weight_version(self.args, version)

    def eval(self, rollout_id: int) -> dict[str, float]:
        """Run every eval set; returns `eval/<name>` mean reward and truncation rate."""
        self.wait_for_engines()
        if not (self.args.eval_prompt_data or getattr(self.args, "eval_config", None)):
            return {}
        output = self._call_rollout_fn(self.eval_fn, rollout_id, evaluation=True)
        data = output.data if isinstance(output, RolloutFnEvalOutput) else output
        metrics = dict(output.metrics) if isinstance(output, RolloutFnEvalOutput) else {}
        if self.args.save_debug_rollout_data:
            self._save_debug_eval_data(rollout_id, data)
        log_function = self.args.custom_eval_rollout_log_function_path
        # The user's f(rollout_id, args, data, extra_metrics) -> True replaces the default eval figures.
        if log_function and load_function(log_function)(rollout_id, self.args, data, metrics):
            return metrics
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
        draw is saved then; a resumed run redraws rollout k+1's prompts. A fully async rollout's groups
        not handed to the trainer yet (in flight or finished) are put back into the saved state as fresh
        prompts, so a resumed run generates them again.
        """
        worker = fully_async_rollout.current_worker()
        if worker is not None:
            with worker.held_draws() as untrained:
                fully_async_rollout.save_data_source(self.data_source, rollout_id, untrained)
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

    def offload(self) -> None:
        self.wait_for_engines()
        if self.monitor is not None:
            self.monitor.pause()  # released engines answer health checks with 503 by design
        ray.get([engine.release_memory_occupation.remote() for engine in self.engines])

    def onload(self) -> None:
        self.wait_for_engines()
        ray.get([engine.resume_memory_occupation.remote() for engine in self.engines])
        if self.monitor is not None:
            self.monitor.resume()

    def dispose(self) -> None:
        """Stop the rollout's background loop, engines and router; leaves no process behind."""
        if self._engines_started is not None:
            with contextlib.suppress(Exception):  # a failed start has cleaned up after itself
                self._engines_started.result()
        fully_async_rollout.stop_worker()
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
        if self.engines and not self.args.rollout_external_engine_addrs:  # never stop engines the user started
            ray.get([engine.shutdown.remote() for engine in self.engines])
            for engine in self.engines:
                ray.kill(engine)
        self.engines = []
        if self.router is not None:
            self.router.stop()
            self.router = None


def wait_for_external_engines(urls: list[str], timeout: float) -> list[str]:
    """Wait until every engine of `--rollout-external-engine-addrs` answers GET /health; returns `urls`.

    Raises:
        TimeoutError: naming the engine that did not answer and the flags to check.
    """
    for url in urls:
        try:
            wait_until_healthy(f"{url}/health", timeout)
        except TimeoutError as e:
            raise TimeoutError(
                f"--rollout-external-engine-addrs: engine {url} did not answer GET /health within "
                f"--rollout-engine-start-timeout {timeout:g} s; start it first, or fix the address ({e})"
            ) from None
    return list(urls)


def create_rollout_manager(args, rollout_slice: PlacementSlice, wait_for_engines: bool = True):
    """Start the RolloutManager actor (it uses no bundle itself); with `wait_for_engines`, return once its engines
    are up, else at once (its engine-using methods wait for them)."""
    manager = ray.remote(num_cpus=0, concurrency_groups={"progress": 1})(RolloutManager).remote(args, rollout_slice)
    if wait_for_engines:
        ray.get(manager.wait_for_engines.remote())
    return manager
