"""Setup and per-step pieces shared by train.py and train_async.py (their loops stay in those files)."""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from slime.ray.actor_group import JobProcessDied, RayTrainGroup
from slime.ray.placement_group import create_placement_groups
from slime.ray.progress import get_with_progress
from slime.ray.rollout import create_rollout_manager
from slime.utils import run_dir
from slime.utils.arguments import parse_args
from slime.utils.job_reaper import start_job_reaper
from slime.utils.lora import engines_keep_base
from slime.utils.run_context import RunContext, expose_to_plugins
from slime.utils.tracking import Tracker, configure_logging

# Data sources whose `save` writes `rollout/data_source_<id>.pt` (a custom one may keep its state elsewhere).
_BUILTIN_DATA_SOURCES = (
    "slime.rollout.data_source.RolloutDataSource",
    "slime.rollout.data_source.RolloutDataSourceWithBuffer",
)

logger = logging.getLogger(__name__)


@dataclass
class TrainingRun:
    """Everything a driver loop needs."""

    args: object
    rollout_manager: object
    actor: RayTrainGroup | None
    critic: RayTrainGroup | None
    tracker: Tracker
    start_rollout_id: int
    num_rollout: int
    num_rollout_per_epoch: int
    weight_version: int = 0  # the trainer labels its n-th weight push n (version 0: nothing pushed yet)
    saved_step: int | None = None  # a checkpoint written this step, committed with the step's metrics row
    placement_groups: list = field(default_factory=list)  # removed when a restart replaces the job's processes

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks: the rollout is split into this many shards."""
        return self.actor.dp_size if self.actor is not None else 1


def check_resume(args) -> int | None:
    """The step `--load` resumes from, once every part of it is known to be there (None: no checkpoint).

    The tracker names a step only after all its parts were written (`save_checkpoint`), so a part can be
    missing only when the run is resumed with other flags (e.g. `--use-critic` added) or files were removed.

    Raises:
        FileNotFoundError: naming the step, the missing parts and the fix.
    """
    step = run_dir.committed_step(args.load)
    if args.train_backend == "fsdp" and args.ckpt_step is not None:  # an FSDP-only flag
        step = args.ckpt_step  # Megatron's --ckpt-step: resume from this step instead of the tracker's
    if step is None:
        return None
    roles = [] if args.debug_rollout_only else ["actor"] + (["critic"] if args.use_critic else [])
    own_data_source = args.data_source_path in _BUILTIN_DATA_SOURCES and not args.finetune
    missing = run_dir.missing_parts(args.load, step, roles, own_data_source)
    if missing:
        raise FileNotFoundError(
            f"--load {args.load}: {run_dir.TRACKER_FILE} names step {step}, but its {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing. Resume with the flags the run was saved with "
            "(e.g. the same --advantage-estimator / --use-critic and --data-source-path), or start a new run "
            "with another --save. A converted model (tools/convert_hf_to_torch_dist.py) is not a run to resume: "
            "pass it as --ref-load, or as --load with --finetune"
        )
    return step


def create_training_run(args) -> TrainingRun:
    """Place devices, start engines and trainers, resume from `--load`, push the first weights."""
    configure_logging()
    resume_step = check_resume(args)  # before any process starts
    slices = create_placement_groups(args)
    # Separate devices: the rollout manager, its engines and the trainer processes all start at once. Colocated,
    # the engines size their memory pools from what is free, so they come up first, alone.
    rollout_manager = create_rollout_manager(args, slices["rollout"], wait_for_engines=args.colocate)
    actor = critic = None
    if not args.debug_rollout_only:
        actor = RayTrainGroup(args, slices["actor"], role="actor")
        critic = RayTrainGroup(args, slices["actor"], role="critic") if args.use_critic else None
    num_rollout, num_rollout_per_epoch = ray.get(rollout_manager.get_num_rollout.remote())
    # The trainers size their LR schedules from args.num_rollout, as upstream's do: resolved here for them (their
    # init, below, is handed these args).
    expose_to_plugins(args, RunContext(num_rollout=num_rollout))

    start_rollout_id = args.start_rollout_id or 0
    weight_version = 0
    if actor is not None:
        actor_init = actor.async_init(with_ref=args.use_kl_loss or args.kl_coef != 0)
        critic_init = critic.async_init() if critic is not None else None  # the critic builds its model meanwhile
        loaded_next_rollout_id = actor.wait(actor_init, "init")[0]
        if critic is not None:
            critic.wait(critic_init, "init")
        if args.start_rollout_id is None:
            start_rollout_id = loaded_next_rollout_id
        if start_rollout_id > 0:
            ray.get(rollout_manager.load.remote(start_rollout_id - 1))
        engines, engine_urls = ray.get([rollout_manager.get_engines.remote(), rollout_manager.get_engine_urls.remote()])
        if engines:
            actor.connect_rollout_engines(engines, engine_urls, rollout_manager)
            if args.offload_train:
                actor.offload()
            if args.offload_rollout:
                ray.get(rollout_manager.onload.remote())
            if not engines_keep_base(args):
                actor.update_weights(rollout_manager)
                weight_version = 1
                ray.get(rollout_manager.set_trainer_weight_version.remote(weight_version))
    elif args.load:
        ray.get(rollout_manager.load.remote(resume_step))

    global _current_run
    _current_run = TrainingRun(
        args=args,
        rollout_manager=rollout_manager,
        actor=actor,
        critic=critic,
        tracker=Tracker(args, start_rollout_id),
        start_rollout_id=start_rollout_id,
        num_rollout=num_rollout,
        num_rollout_per_epoch=num_rollout_per_epoch,
        weight_version=weight_version,
        placement_groups=list({id(s.pg): s.pg for s in slices.values() if s.pg is not None}.values()),
    )
    return _current_run


def generate_rollout(run: TrainingRun, rollout_id: int) -> Any:
    """`RolloutManager.generate` of `rollout_id`, with the manager's progress bars drawn meanwhile.

    Under `--use-fault-tolerance` a replaced engine joins the router only once it holds the current weights, which
    the step's push brings after the rollout; if every engine was replaced during a rollout, no engine serves it and
    it fails. The replacements then get the weights now and the rollout runs again (its groups went back to the
    data source when it failed), at most `_PUSH_ATTEMPTS` times.
    """
    manager = run.rollout_manager
    for attempt in range(_PUSH_ATTEMPTS):
        try:
            return get_with_progress(manager, manager.generate.remote(rollout_id, run.dp_size))
        except ray.exceptions.RayError as error:
            if isinstance(error, ray.exceptions.RayActorError) or attempt == _PUSH_ATTEMPTS - 1:
                raise
            if not (run.args.use_fault_tolerance and run.actor is not None):
                raise
            waiting = ray.get(manager.engines_awaiting_weights.remote())
            if not waiting:
                raise
            logger.warning(
                "rollout %d failed while replaced engines %s waited for the current weights: pushing them and "
                "generating it again", rollout_id, waiting,
            )  # fmt: skip
            update_weights(run)
    raise AssertionError(f"rollout {rollout_id}: no attempt left")  # the last attempt returns or raises


def train_one_rollout(run: TrainingRun, rollout_id: int, data_refs: list) -> dict[str, float]:
    """Critic first (its values feed the actor's GAE), then the actor unless still in critic-only steps."""
    what = f"training on rollout {rollout_id}"
    if run.critic is None:
        return run.actor.wait(run.actor.async_train(rollout_id, data_refs), what)[0]
    values_refs = run.critic.compute_values(data_refs)
    critic_handles = run.critic.async_train(rollout_id, data_refs)
    metrics: dict[str, float] = {}
    if rollout_id >= run.args.num_critic_only_steps:
        metrics |= run.actor.wait(run.actor.async_train(rollout_id, data_refs, values_refs=values_refs), what)[0]
    critic_metrics = run.critic.wait(critic_handles, what)[0]
    metrics |= {k if k.startswith("perf/") else f"critic/{k.split('/', 1)[-1]}": v for k, v in critic_metrics.items()}
    return metrics


# Pushes per weight update while engines keep dying under it (each retry follows a restart).
_PUSH_ATTEMPTS = 3


def update_weights(run: TrainingRun) -> dict[str, float]:
    """Push the trainer's weights to the engines, including engines restarted by `--use-fault-tolerance`, and tell
    the rollout manager the new weight version (the fully async rollout's staleness is measured against it).

    A restarted engine is not in the trainer's weight-update links yet (a broadcast group is formed
    with the engines it had) and still holds the checkpoint's weights: the trainer reconnects to the
    engines, pushes, checks every engine's log-probs against its own, and only then is the engine
    put back into the router. With `--lora-train-only` nothing is pushed: the engines keep the base they loaded.
    """
    manager = run.rollout_manager
    restarted = ray.get(manager.engines_awaiting_weights.remote()) if run.args.use_fault_tolerance else []
    if engines_keep_base(run.args):  # --lora-train-only: nothing is pushed; a restarted engine has the base already
        if restarted:
            ray.get(manager.readmit_engines.remote(restarted))
        return {}
    for attempt in range(_PUSH_ATTEMPTS):
        try:
            _push_weights(run, reconnect=bool(restarted) or attempt > 0)
            break
        except JobProcessDied:  # a trainer rank or the rollout manager: no engine restart helps
            raise
        except Exception:
            # An engine that died after the rollout's last request or during a push (also during the push made
            # again after a restart): restarted (with --use-fault-tolerance; the push is then made again, to every
            # engine) or named, without the flag. A failure with no dead engine behind it is raised as it is.
            restarted = ray.get(manager.replace_dead_engines.remote("updating the engines' weights"))
            if not restarted or attempt == _PUSH_ATTEMPTS - 1:
                raise
    run.weight_version += 1
    ray.get(manager.set_trainer_weight_version.remote(run.weight_version))
    if not restarted:
        return {}
    gap = run.actor.check_weights_equal()
    ray.get(manager.readmit_engines.remote(restarted))
    return {"rollout/restarted_engine_weight_gap": gap}


def _push_weights(run: TrainingRun, reconnect: bool) -> None:
    if reconnect:  # restarted engines have new URLs and are in no weight-update link yet
        manager = run.rollout_manager
        engines, engine_urls = ray.get([manager.get_engines.remote(), manager.get_engine_urls.remote()])
        run.actor.connect_rollout_engines(engines, engine_urls, run.rollout_manager)
    run.actor.update_weights(run.rollout_manager)


def save_checkpoint(run: TrainingRun, rollout_id: int) -> None:
    """Write the parts of the checkpoint of `rollout_id`: actor, critic and data source. `log_step` commits it (the
    tracker file naming the step) once the step's metrics row is logged.

    Killed before the commit, the run resumes from the previous step, all of whose parts are there, and redoes
    this one, metrics row included; a committed step always has its row.
    """
    run.actor.save_model(rollout_id, update_tracker=False)
    if run.critic is not None:
        run.critic.save_model(rollout_id, update_tracker=False)
    ray.get(run.rollout_manager.save.remote(rollout_id))
    run.saved_step = rollout_id


def log_step(run: TrainingRun, rollout_id: int, metrics: dict[str, float]) -> None:
    """Log the step's metrics row, then commit the checkpoint the step saved, if it saved one."""
    run.tracker.log(rollout_id, metrics)
    if run.saved_step == rollout_id:
        run_dir.commit_step(run.args.save, rollout_id)
        run.saved_step = None


def run_driver(train_fn: Callable[[Any], None], argv: list[str] | None = None) -> None:
    """Parse the command line and run `train_fn(args)`; a failure ends with one line naming its cause.

    The traceback (including the remote one Ray carries) is printed first; the last line is the
    message of the exception that started it, so a user sees what failed without reading Ray's frames.
    A job reaper (slime.utils.job_reaper) stops every process of the job still running once the driver exited.

    With `--use-fault-tolerance` and `--save`, a trainer rank or the rollout manager that dies does not end the run:
    the job's processes are stopped and the run starts again from the last committed checkpoint (as `--load
    <--save>` would), at most `--max-restarts` times; the tracker continues the same run.
    """
    args = parse_args(argv)
    start_job_reaper()  # whatever ends this process, the job's processes end with it
    attempt_args, restarts = args, 0
    while True:
        try:
            train_fn(attempt_args)
            return
        except Exception as error:
            cause = error
            while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None:
                cause = cause.cause
            if not _restartable(args, cause, restarts):
                _exit_naming(cause)
            restarts += 1
            logger.warning(
                "slime: %s: %s; restart %d of --max-restarts %d from the last checkpoint in --save %s",
                type(cause).__name__, _summary(cause), restarts, args.max_restarts, args.save,
            )  # fmt: skip
            _close_failed_attempt()
            attempt_args = copy.copy(args)
            attempt_args.load, attempt_args.start_rollout_id = args.save, None


def _restartable(args, cause: BaseException, restarts: int) -> bool:
    """A trainer rank or the rollout manager died, and the flags allow another restart from a checkpoint."""
    died = isinstance(cause, JobProcessDied | ray.exceptions.RayActorError)
    return died and args.use_fault_tolerance and bool(args.save) and restarts < args.max_restarts


# The run being set up or trained in this process: a restart closes the failed attempt's tracker first.
_current_run: TrainingRun | None = None


def _close_failed_attempt() -> None:
    """End the failed attempt's processes and tracker; the Ray cluster stays for the next attempt (engines and
    the router go with the rollout manager that owns them)."""
    global _current_run
    run, _current_run = _current_run, None
    if run is None:  # it failed while being set up: end the whole Ray job instead
        ray.shutdown()
        return
    with contextlib.suppress(Exception):
        run.tracker.finish()
    for group in (run.actor, run.critic):
        if group is not None:
            group.dispose()
    ray.kill(run.rollout_manager, no_restart=True)
    for pg in run.placement_groups:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(pg)


def _summary(cause: BaseException) -> str:
    message = (str(cause.args[0]) if cause.args else str(cause)).strip()
    if isinstance(cause, ray.exceptions.RayActorError) and cause.actor_init_failed and message:
        # An actor whose __init__ raised: Ray's message is a header, then the traceback, the error last.
        return message.splitlines()[-1].strip()
    return message.splitlines()[0] if message else ""


def _exit_naming(cause: BaseException) -> None:
    traceback.print_exc()
    # Ray relays the actors' stderr asynchronously: stop it first so the summary really is the last line.
    ray.shutdown()
    sys.exit(f"slime: {type(cause).__name__}: {_summary(cause)}")


def finish(run: TrainingRun) -> None:
    run.tracker.finish()
    ray.get(run.rollout_manager.dispose.remote())
