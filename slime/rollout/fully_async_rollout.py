"""Fully asynchronous rollout: one background loop per rollout process keeps generating while the trainer trains.

    python train_async.py --rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async ...

The rollout manager starts a `FullyAsyncRollout` (the function's `lifecycle`), which owns the loop; its first
training call starts the loop on the process's shared asyncio thread. It keeps up to
`--over-sampling-batch-size` prompt groups (default `--rollout-batch-size`) in the pipeline, in flight or
finished and waiting, drawing prompts from the data source one group at a time; each call hands the
trainer the first `--rollout-batch-size` finished groups and returns, while the loop refills.

A weight push pauses the engines, which abort the requests in flight; the loop sends each aborted request
again at once, and the engines hold it until the push is over. With `--partial-rollout` it continues from its
partial response (its `weight_versions` then name both weights), otherwise it starts over from the prompt.

Staleness: every sample records the weight version of each generation (`Sample.weight_versions`, from the
engine's `meta_info.weight_version`); the trainer numbers its pushes 1, 2, ... and the run context gives the
version being trained (the rollout manager calls `on_weights_updated` after each push). A group's staleness is
that version minus the oldest version among its samples. With `--max-weight-staleness N`, a group over N is
never handed to the trainer: `--staleness-policy drop` puts its prompts back into the data source (served
first by the buffer), `regenerate` generates it again at once under the current weights. N = 0 trains on
policy: what was generated during a train step is stale after the push that follows it. Staleness counts
pushes: with `--update-weights-interval I` one push spans I train steps.

Exactly once: a prompt group is in exactly one place, the data source, the pipeline, or a batch handed out
(groups `--dynamic-sampling-filter-path` drops are used up, as in the default rollout).
On save the groups in the pipeline are put back into the *saved* data source state as fresh prompts, so a run
resumed with `--load` generates them again; the live run keeps them. Their responses are not saved: a partial one
lives in the engines until its request ends, and finished ones carry push numbers the resumed run restarts.

Eval (`evaluation=True`) runs the default eval on the same asyncio loop, beside the generation loop.

Metrics of each call (since the previous one): rollout/staleness_mean and staleness_max (over the samples
handed out, in weight pushes), stale_groups (dropped or regenerated), batch_wait_time (this call waiting for
finished groups), generation_wait_time (the loop with nothing in flight: its pipeline full, waiting for the
trainer), submitted_groups, aborted_requests, dropped_groups (the dynamic filter's) and pipeline_groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer
from slime.rollout.filter_hub.base_types import MetricGatherer, call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.rm_hub import batched_async_rm
from slime.rollout.sglang_rollout import (
    DefaultRollout,
    RolloutState,
    finish_rollout_batch,
    generate_and_rm,
    generate_function_name,
    get_state,
    reset_to_prompt,
    sampling_params_from_args,
    start_state,
)
from slime.utils import progress
from slime.utils.async_utils import get_event_loop, run
from slime.utils.run_context import RunContext
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

STALENESS_POLICIES = ("drop", "regenerate")
# A weight push aborts a request once; this many aborts of one sample mean the engines are failing.
MAX_ABORTS_PER_SAMPLE = 8


# ---------------------------------------------------------------------------------------------
# Staleness
# ---------------------------------------------------------------------------------------------


def _version_number(sample: Sample, version: str) -> int:
    try:
        return int(version)
    except (TypeError, ValueError):
        raise ValueError(
            f"sample {sample.index} carries weight versions {sample.weight_versions}: --max-weight-staleness needs "
            "the integer weight version the engine reports for every generation (the trainer numbers its pushes "
            "1, 2, ...); a --custom-generate-function-path function must append meta_info['weight_version'] to "
            "sample.weight_versions"
        ) from None


def oldest_weight_version(samples: list[Sample]) -> int:
    """The oldest weight version any token of `samples` was sampled under.

    Raises:
        ValueError: A sample recorded no version, or one that is not an integer.
    """
    oldest = None
    for sample in samples:
        if not sample.weight_versions:
            raise ValueError(
                f"sample {sample.index} recorded no weight version: --max-weight-staleness needs the version the "
                "engine reports (meta_info['weight_version']) in sample.weight_versions"
            )
        version = min(_version_number(sample, v) for v in sample.weight_versions)
        oldest = version if oldest is None else min(oldest, version)
    if oldest is None:
        raise ValueError("an empty group has no weight version")
    return oldest


def group_staleness(group: list[Sample], trainer_version: int) -> int:
    """How many weight pushes the group's oldest token is behind `trainer_version` (0 when it is not behind)."""
    return max(0, trainer_version - oldest_weight_version(group))


def split_stale(
    groups: list[list[Sample]], trainer_version: int | None, max_staleness: int | None
) -> tuple[list[list[Sample]], list[list[Sample]]]:
    """Split groups into (within the bound, over it), each in the given order.

    Args:
        groups: Generated groups.
        trainer_version: The weight version the trainer trains from.
        max_staleness: Most staleness a group may have (`--max-weight-staleness`); None keeps every group.

    Raises:
        ValueError: A bound is set but the trainer's version is unknown, or a sample's versions cannot be read.
    """
    if max_staleness is None:
        return list(groups), []
    if trainer_version is None:
        raise ValueError(
            "--max-weight-staleness: the trainer's weight version is unknown; train.py and train_async.py tell the "
            "rollout manager after each push, a custom driver must call RolloutManager.set_trainer_weight_version "
            "(outside a manager: give the rollout a RunContext whose weight_version_source knows it)"
        )
    fresh, stale = [], []
    for group in groups:
        (stale if group_staleness(group, trainer_version) > max_staleness else fresh).append(group)
    return fresh, stale


def staleness_metrics(groups: list[list[Sample]], trainer_version: int | None) -> dict[str, float]:
    """`rollout/staleness_mean` and `rollout/staleness_max` over the samples of `groups` ({} when not measurable:
    no trainer version, or samples without integer weight versions)."""
    if trainer_version is None or not groups:
        return {}
    try:
        values = [group_staleness([s], trainer_version) for group in groups for s in group]
    except ValueError:
        return {}
    return {"rollout/staleness_mean": sum(values) / len(values), "rollout/staleness_max": float(max(values))}


# ---------------------------------------------------------------------------------------------
# The background loop
# ---------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """One prompt group in the pipeline: the prompts as drawn (to put back or regenerate from) and its samples."""

    prompts: list[Sample]
    samples: list[Sample] | None = None


class FullyAsyncWorker:
    """The generation loop of one rollout process; every method that changes its state runs on the asyncio loop.

    Args:
        args: Parsed arguments; reads rollout_batch_size, over_sampling_batch_size (the pipeline's capacity),
            max_weight_staleness, staleness_policy, partial_rollout, group_rm, dynamic_sampling_filter_path.
        data_source: Where prompt groups come from and dropped ones go back to (it needs a buffer).
        state: The rollout state its generations use (hooks, concurrency cap).
        context: The run's context: the trainer's weight version staleness is judged against.
    """

    def __init__(self, args, data_source, state: RolloutState, context: RunContext):
        if isinstance(data_source, RolloutDataSource) and not isinstance(data_source, RolloutDataSourceWithBuffer):
            raise ValueError(
                "the fully async rollout puts prompt groups back into the data source (stale groups, saves), which "
                f"{type(data_source).__name__} cannot take: use --data-source-path "
                "slime.rollout.data_source.RolloutDataSourceWithBuffer (the default)"
            )
        self.args, self.data_source, self.state, self.context = args, data_source, state, context
        self.capacity = args.over_sampling_batch_size or args.rollout_batch_size
        self.sampling_params = sampling_params_from_args(args)
        self.loop = get_event_loop()
        self.in_flight: dict[asyncio.Future, _Group] = {}
        self.finished: deque[_Group] = deque()
        self.filtered: list[list[Sample]] = []  # groups the dynamic filter dropped since the last hand-out
        self.error: BaseException | None = None
        self.held = False  # a save reads the data source: no draws, no drops meanwhile
        self.next_rollout_id = 0
        self.counts = dict.fromkeys(("submitted", "stale", "filtered", "aborted", "empty"), 0)
        self.metric_gatherer = MetricGatherer()
        self.idle_time, self.idle_since = 0.0, None  # seconds with nothing in flight; since when
        self._wake_loop, self._wake_taker = asyncio.Event(), asyncio.Event()
        self._main = asyncio.run_coroutine_threadsafe(self._run(), self.loop)
        logger.info(
            "fully async rollout: background generation started, up to %d groups in flight or waiting", self.capacity
        )

    # ---- loop thread -------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self.state.ensure_started()
            while True:
                self._fill()
                await self._wake_loop.wait()
                self._wake_loop.clear()
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            logger.error("fully async rollout loop failed: %r", error)
            self.error = error
        self._wake_taker.set()

    def _changed(self) -> None:
        now = time.monotonic()
        if self.in_flight and self.idle_since is not None:
            self.idle_time += now - self.idle_since
            self.idle_since = None
        elif not self.in_flight and self.idle_since is None:
            self.idle_since = now
        self._wake_loop.set()
        self._wake_taker.set()

    def _fill(self) -> None:
        while self.error is None and not self.held and len(self.in_flight) + len(self.finished) < self.capacity:
            groups = self.data_source.get_samples(1)
            if not groups:
                raise RuntimeError(f"the data source {type(self.data_source).__name__} returned no prompt group")
            for group in groups:
                for sample in group:
                    sample.rollout_id = self.next_rollout_id
                self._submit(_Group(prompts=[copy.deepcopy(s) for s in group]))

    def _submit(self, group: _Group) -> None:
        group.samples = None
        task = asyncio.ensure_future(self._generate_group([copy.deepcopy(s) for s in group.prompts]))
        self.in_flight[task] = group
        self.counts["submitted"] += 1
        task.add_done_callback(self._on_done)
        self._changed()

    def _on_done(self, task: asyncio.Future) -> None:
        group = self.in_flight.pop(task)
        try:
            if task.cancelled():
                return
            if task.exception() is not None:
                self._fail(task.exception())
                return
            group.samples = task.result()
            if not group.samples:
                logger.warning(
                    "%s returned no samples for prompt group %s; the group is dropped",
                    generate_function_name(self.args, group.prompts[0]),
                    group.prompts[0].group_index,
                )
                self.counts["empty"] += 1
                return
            verdict = call_dynamic_filter(self.state.dynamic_filter, self.args, group.samples)
            # The groups still in the running: those in flight or waiting, and this one.
            remaining = len(self.in_flight) + len(self.finished) + 1
            if should_drop_dynamic_filter_output(
                verdict, remaining_batch_size=remaining, target_data_size=self.args.rollout_batch_size
            ):
                self.counts["filtered"] += 1
                self.metric_gatherer.on_dynamic_filter_drop(verdict.reason)
                self.filtered.append(group.samples)
                return
            self.finished.append(group)
            self._sort_out_stale()
        except Exception as error:  # a done-callback's exception would only be logged by asyncio
            self._fail(error)
        finally:
            self._changed()

    async def _generate_group(self, samples: list[Sample]) -> list[Sample]:
        results = await asyncio.gather(*(self._generate_sample(s) for s in samples))
        samples = [s for result in results for s in result]
        if self.args.group_rm and samples:
            for s, reward in zip(samples, await batched_async_rm(self.args, samples), strict=True):
                s.reward = reward
        return samples

    async def _generate_sample(self, sample: Sample) -> list[Sample]:
        """Generate and score one sample, sending it again after each abort (a weight push aborts it once)."""
        prompt = reset_to_prompt(sample)
        # Only the built-in generate continues a partial response; custom and agent generations start over.
        custom = self.state.custom_generate is not None or self.args.agent_function_path
        can_continue = self.args.partial_rollout and not custom
        for _ in range(MAX_ABORTS_PER_SAMPLE):
            result = await generate_and_rm(self.args, sample, self.sampling_params)
            samples = result if isinstance(result, list) else [result]
            if not any(s.status == Status.ABORTED for s in samples):
                return samples
            self.counts["aborted"] += 1
            if can_continue and not isinstance(result, list):
                sample = result  # generate continues a partial response
                sample.status = Status.PENDING
            else:
                sample = reset_to_prompt(prompt)
        raise RuntimeError(
            f"the engines aborted sample {prompt.index} {MAX_ABORTS_PER_SAMPLE} times (a weight push aborts it "
            "once); check the engine logs (in $TMPDIR/slime_logs)"
        )

    def _sort_out_stale(self) -> None:
        """Take the finished groups over the staleness bound out of the pipeline, per `--staleness-policy`."""
        if self.held or self.args.max_weight_staleness is None or not self.finished:
            return
        version = self.context.trainer_weight_version()
        _, stale = split_stale([g.samples for g in self.finished], version, self.args.max_weight_staleness)
        if not stale:
            return
        stale_ids = {id(samples) for samples in stale}
        stale_groups = [g for g in self.finished if id(g.samples) in stale_ids]
        self.finished = deque(g for g in self.finished if id(g.samples) not in stale_ids)
        for group in stale_groups:
            self.counts["stale"] += 1
            if self.args.staleness_policy == "regenerate":
                self._submit(group)
            else:
                self.data_source.add_samples([[copy.deepcopy(s) for s in group.prompts]])

    async def _take(self, rollout_id: int, target: int, started: float) -> RolloutFnTrainOutput:
        kept: list[list[Sample]] = []
        # The bar counts finished groups taken for this batch: those the loop made while the trainer trained at once.
        progress_key = f"rollout {rollout_id}"
        progress.start(progress_key, f"rollout {rollout_id}", target, "group")
        try:
            while len(kept) < target:
                if self.error is not None:
                    raise RuntimeError(f"the fully async rollout loop failed: {self.error}") from self.error
                self._sort_out_stale()
                while self.finished and len(kept) < target:
                    kept.append(self.finished.popleft().samples)
                    progress.advance(progress_key)
                if len(kept) < target:
                    self._wake_loop.set()
                    self._wake_taker.clear()
                    await self._wake_taker.wait()
        finally:
            progress.finish(progress_key)
        self._changed()  # room in the pipeline: generate the next batch while this one trains
        now = time.monotonic()
        if self.idle_since is not None:
            self.idle_time += now - self.idle_since
            self.idle_since = now

        for group in kept:
            for sample in group:
                sample.rollout_id = rollout_id
        self.next_rollout_id = rollout_id + 1
        # User hooks run here, on the loop, so that none touches the data source while the loop draws from it.
        kept = finish_rollout_batch(self.args, kept, self.filtered, self.data_source)
        metrics = {
            "rollout/batch_wait_time": now - started,
            "rollout/generation_wait_time": self.idle_time,
            "rollout/submitted_groups": float(self.counts["submitted"]),
            "rollout/stale_groups": float(self.counts["stale"]),
            "rollout/dropped_groups": float(self.counts["filtered"]),
            "rollout/aborted_requests": float(self.counts["aborted"]),
            "rollout/empty_groups": float(self.counts["empty"]),
            "rollout/pipeline_groups": float(len(self.in_flight) + len(self.finished)),
        }
        metrics |= self.metric_gatherer.collect()
        self.metric_gatherer = MetricGatherer()
        metrics |= staleness_metrics(kept, self.context.trainer_weight_version())
        self.filtered, self.idle_time = [], 0.0
        self.counts = dict.fromkeys(self.counts, 0)
        return RolloutFnTrainOutput(samples=kept, metrics=metrics)

    async def _hold(self) -> list[list[Sample]]:
        self.held = True
        groups = [g.prompts for g in self.in_flight.values()] + [g.prompts for g in self.finished]
        groups.sort(key=lambda g: g[0].group_index if g[0].group_index is not None else 0)
        return [[copy.deepcopy(s) for s in group] for group in groups]

    async def _release(self) -> None:
        self.held = False
        try:
            self._sort_out_stale()
        except Exception as error:
            self._fail(error)
        self._changed()

    async def _stop(self) -> None:
        self._main.cancel()
        tasks = list(self.in_flight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- any other thread --------------------------------------------------------------------
    def take(self, rollout_id: int, target: int) -> RolloutFnTrainOutput:
        """Wait for `target` finished groups within the staleness bound; returns them sorted by group index,
        with the loop's metrics since the last call."""
        return run(self._take(rollout_id, target, time.monotonic()))

    @contextlib.contextmanager
    def held_draws(self) -> Iterator[list[list[Sample]]]:
        """Stop drawing from (and putting back into) the data source; yields the groups not handed out yet,
        as fresh prompts sorted by group index. The loop goes on generating what it has meanwhile."""
        groups = run(self._hold())
        try:
            yield groups
        finally:
            run(self._release())

    def version_changed(self) -> None:
        """The trainer's weight version moved on: re-judge the finished groups (thread-safe)."""

        def sort_out() -> None:
            try:
                self._sort_out_stale()
            except Exception as error:
                self._fail(error)
            self._changed()

        self.loop.call_soon_threadsafe(sort_out)

    def stop(self) -> None:
        """Cancel the loop and every generation in flight."""
        run(self._stop())


def save_data_source(data_source, rollout_id: int, untrained: list[list[Sample]]) -> None:
    """Save the data source as if the `untrained` groups had been put back; the live data source is left as it was.

    Raises:
        TypeError: The data source cannot hold groups put back (no `state_dict` / `add_samples`).
    """
    if not untrained:
        data_source.save(rollout_id)
        return
    if not (hasattr(data_source, "state_dict") and hasattr(data_source, "load_state_dict")):
        raise TypeError(
            f"saving the fully async rollout puts {len(untrained)} untrained groups back into the data source's "
            f"checkpoint, but {type(data_source).__name__} has no state_dict/load_state_dict; use "
            "slime.rollout.data_source.RolloutDataSourceWithBuffer or give yours those methods"
        )
    live = copy.deepcopy(data_source.state_dict())
    data_source.add_samples(untrained)
    try:
        data_source.save(rollout_id)
    finally:
        data_source.load_state_dict(live)


class FullyAsyncRollout:
    """The fully async rollout as the rollout manager runs it: it owns the background loop, hears of weight pushes,
    saves the data source with its pipeline put back, and stops the loop on close.

    Args:
        args: Parsed slime arguments (see `FullyAsyncWorker`).
        context: The run's context (the trainer's weight version, the engines).
        data_source: Source of prompt groups; it feeds the loop for good.
    """

    # The driver asks for each batch only when it is about to train on it (train_async.py).
    generates_in_background = True

    def __init__(self, args, context: RunContext, data_source):
        self.context, self.data_source = context, data_source
        self.eval_rollout = DefaultRollout(args, context, data_source)
        self.worker: FullyAsyncWorker | None = None

    def __call__(self, args, rollout_id: int, data_source, evaluation: bool = False):
        """`--rollout-batch-size` groups from the loop (started by the first call), or the default eval.

        Returns:
            `RolloutFnTrainOutput` with the loop's metrics since the last call (staleness_mean/max, stale_groups,
            batch_wait_time, generation_wait_time, ...), or the eval output.
        """
        if evaluation:
            return self.eval_rollout(args, rollout_id, data_source, evaluation=True)
        if data_source is not self.data_source:
            raise ValueError("the fully async loop draws from the data source it was started with, not this one")
        if self.worker is None:
            self.worker = FullyAsyncWorker(args, data_source, start_state(args, self.context), self.context)
        return self.worker.take(rollout_id, args.rollout_batch_size)

    def on_weights_updated(self, version: int) -> None:
        """The trainer pushed weights `version` (the context tells it from now on): re-judge the finished groups."""
        if self.worker is not None:
            self.worker.version_changed()

    def save(self, rollout_id: int) -> None:
        """Save the data source with the groups not handed to the trainer yet put back as fresh prompts (in the
        checkpoint only: the live loop keeps them)."""
        if self.worker is None:
            self.data_source.save(rollout_id)
            return
        with self.worker.held_draws() as untrained:
            save_data_source(self.data_source, rollout_id, untrained)

    def close(self) -> None:
        """Stop the loop and every generation in flight."""
        if self.worker is not None:
            worker, self.worker = self.worker, None
            worker.stop()


# A script or test that calls `generate_rollout_fully_async` itself (no rollout manager) gets one rollout per
# process, on this process's rollout state; `stop_worker` ends it. The rollout manager starts its own through
# `lifecycle` and never touches this one.
_DIRECT: FullyAsyncRollout | None = None


def stop_worker() -> None:
    """Stop the loop of the direct calls of this process, if one runs."""
    global _DIRECT
    if _DIRECT is not None:
        rollout, _DIRECT = _DIRECT, None
        rollout.close()


def generate_rollout_fully_async(args, rollout_id: int, data_source, evaluation: bool = False):
    """`--rollout-function-path` entry of the fully async rollout. The rollout manager runs a `FullyAsyncRollout` of
    its own (this function's `lifecycle`); called directly, this is the process's one (see `_DIRECT`).

    Args:
        args: Parsed slime arguments (see `FullyAsyncWorker`).
        rollout_id: The rollout step the returned groups are trained in.
        data_source: Source of prompt groups; the first training call's data source feeds the loop for good.
        evaluation: Run the eval sets (the default eval), beside the generation loop.

    Returns:
        `RolloutFnTrainOutput` with `--rollout-batch-size` groups and the loop's metrics since the last call
        (staleness_mean/max, stale_groups, batch_wait_time, generation_wait_time, ...), or the eval output.
    """
    global _DIRECT
    if _DIRECT is None:
        _DIRECT = FullyAsyncRollout(args, get_state(args).context, data_source)
    return _DIRECT(args, rollout_id, data_source, evaluation)


generate_rollout_fully_async.lifecycle = FullyAsyncRollout
