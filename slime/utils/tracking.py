"""Per-step metrics: one printed line per rollout, plus wandb / TensorBoard when enabled, and the `--ci-test`
checks on them.

Every tracker flag left unset falls back to the environment variable of the tool's own meaning, so a flag
overrides the environment (as upstream, which sets `WANDB_MODE` from `--wandb-mode`):

    --wandb-mode        WANDB_MODE        (else online)
    --wandb-project     WANDB_PROJECT     (else "slime")
    --wandb-team        WANDB_ENTITY      (else the API key's default entity)
    --wandb-group       WANDB_RUN_GROUP
    --wandb-dir         WANDB_DIR         (else the working directory)
    --wandb-key         WANDB_API_KEY     (else `wandb login`'s; never put in the run config)
    --wandb-host        WANDB_BASE_URL    (else https://api.wandb.ai)
    --wandb-run-id      WANDB_RUN_ID      (else, when resuming from --load, the id that run saved; else new)
    --tensorboard-dir   TENSORBOARD_DIR   (else tensorboard_log/<--tb-project-name>/<--tb-experiment-name>)

A resumed run (`--load` with a checkpoint) continues the wandb run whose id the earlier run saved in
`--save/wandb_run_id.txt` (`resume="allow"`).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any

from slime.utils.atomic_dir import atomic_write_text
from slime.utils.engine_args import engine_api_key

logger = logging.getLogger("slime")

WANDB_RUN_ID_FILE = "wandb_run_id.txt"  # in --save: the wandb run a resume of this run continues
TRAIN_PREFIXES = ("train/", "critic/")  # plotted against train/step in wandb; the rest against rollout/step

# (metric key, label, unit) of the per-rollout line, in print order; missing keys are skipped.
STEP_LINE_FIELDS = (
    ("rollout/reward", "reward", ""),
    ("train/kl_loss", "kl", ""),
    ("train/ppo_kl", "ppo_kl", ""),
    ("train/loss", "loss", ""),
    ("train/mtp_loss", "mtp_loss", ""),
    ("train/grad_norm", "grad_norm", ""),
    ("rollout/response_length", "resp_len", ""),
    ("rollout/truncated", "truncated", ""),
    ("rollout/tokens_per_s", "rollout_tok/s", ""),
    ("train/tokens_per_s", "train_tok/s", ""),
    ("perf/generate_time", "gen", "s"),
    ("perf/train_wait_time", "wait", "s"),
    ("perf/train_time", "train", "s"),
    ("perf/update_weights_time", "sync", "s"),
    ("perf/actor_train_mfu", "mfu", ""),
    ("perf/actor_peak_memory_gb", "train_mem", "GB"),
    ("perf/step_time", "step_time", "s"),
)


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


def format_value(value: Any) -> str:
    """A metric as the log line shows it: 4 significant digits, so small values stay visible.

    `0.4123`, `-0.0101`, `1.2e-05`, `41.2`; from 1000 on no decimals (`12346`); integers, 0, nan and inf as
    they are; anything else with `str`.
    """
    if isinstance(value, numbers.Integral):
        return str(value)
    if not isinstance(value, numbers.Real):
        return str(value)
    value = float(value)
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


def format_step_line(rollout_id: int, metrics: dict[str, Any]) -> str:
    """`rollout 3 | reward 0.412 | kl 1.2e-05 | loss -0.0101 | ... | step_time 41.2s | eval_math 0.35`."""
    parts = [f"rollout {rollout_id}"]
    for key, label, unit in STEP_LINE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {format_value(metrics[key])}{unit}")
    for key, value in sorted(metrics.items()):
        if key.startswith("eval/") and key.count("/") == 1:  # eval/<set name>: that set's mean reward
            parts.append(f"eval_{key[5:]} {format_value(value)}")
    return " | ".join(parts)


class CICheckFailed(RuntimeError):
    """A metric checked under `--ci-test` crossed its threshold."""


class CIChecks:
    """The `--ci-test` checks, run on every logged row (upstream's CI gates):

    - KL: on the first rollout this run trains, `train/ppo_kl` is exactly 0 (old log-probs and the training
      forward see the same weights) and, at rollout 0 without `--ref-load`, so is `train/kl_loss`. Checked
      when a rollout has one optimizer step (its metrics are then that step's); `--ci-disable-kl-checker`.
    - `train/train_rollout_logprob_abs_diff` at most `--ci-train-rollout-logprob-abs-diff-threshold`.
    - `--ci-save-grad-norm` / `--ci-load-grad-norm`: write `train/grad_norm` per rollout, or compare it with
      the written one (relative tolerance 1%).
    - `--ci-metric-checker-key` / `--ci-metric-checker-threshold`: at the end some logged value of the key
      must be at least the threshold.
    """

    GRAD_NORM_RTOL = 0.01

    def __init__(self, args):
        self.args = args
        self.kl_checked = bool(args.ci_disable_kl_checker)
        self.checked_values: list[float] = []

    def _fail(self, rollout_id: int, message: str) -> None:
        raise CICheckFailed(f"--ci-test, rollout {rollout_id}: {message}")

    def on_log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        args = self.args
        if not self.kl_checked and "train/ppo_kl" in metrics:
            self.kl_checked = True
            if args.num_steps_per_rollout == 1:
                checked = ["train/ppo_kl"]
                if rollout_id == 0 and not args.ref_load and "train/kl_loss" in metrics:
                    checked.append("train/kl_loss")
                for key in checked:
                    if metrics[key] != 0:
                        self._fail(rollout_id, f"{key} is {metrics[key]!r} on the first step, not 0")
        gap = metrics.get("train/train_rollout_logprob_abs_diff")
        if gap is not None and not gap <= args.ci_train_rollout_logprob_abs_diff_threshold:
            self._fail(
                rollout_id,
                f"train/train_rollout_logprob_abs_diff {gap:.4g} exceeds "
                f"--ci-train-rollout-logprob-abs-diff-threshold {args.ci_train_rollout_logprob_abs_diff_threshold}",
            )
        grad_norm = metrics.get("train/grad_norm")
        if grad_norm is not None and args.ci_save_grad_norm:
            path = Path(args.ci_save_grad_norm.format(rollout_id=rollout_id))
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"rollout_id": rollout_id, "grad_norm": grad_norm}))
        if grad_norm is not None and args.ci_load_grad_norm:
            path = Path(args.ci_load_grad_norm.format(rollout_id=rollout_id))
            if not path.is_file():
                self._fail(rollout_id, f"--ci-load-grad-norm: no saved grad norm {path}")
            expected = json.loads(path.read_text())["grad_norm"]
            if not math.isclose(grad_norm, expected, rel_tol=self.GRAD_NORM_RTOL):
                self._fail(rollout_id, f"train/grad_norm {grad_norm!r} differs from the saved {expected!r} ({path})")
        key = args.ci_metric_checker_key
        if key is not None and key in metrics:
            self.checked_values.append(float(metrics[key]))
            logger.info("--ci-test: %s = %.4g (needs %.4g once)", key, metrics[key], args.ci_metric_checker_threshold)

    def on_finish(self) -> None:
        key, threshold = self.args.ci_metric_checker_key, self.args.ci_metric_checker_threshold
        if key is None:
            return
        if not self.checked_values:
            raise CICheckFailed(f"--ci-test: {key} was never logged, so --ci-metric-checker-key could not be checked")
        if max(self.checked_values) < threshold:
            raise CICheckFailed(
                f"--ci-test: {key} never reached --ci-metric-checker-threshold {threshold} "
                f"(values {', '.join(f'{v:.4g}' for v in self.checked_values)})"
            )


def wandb_run_id(args, start_rollout_id: int) -> str:
    """The wandb run to log into: `--wandb-run-id`, else `WANDB_RUN_ID`, else (resuming from a `--load`
    checkpoint) the id the earlier run saved there, else a new one (8 lowercase letters and digits, as wandb's)."""
    if args.wandb_run_id:
        return args.wandb_run_id
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    saved = Path(args.load) / WANDB_RUN_ID_FILE if args.load and start_rollout_id > 0 else None
    if saved is not None and saved.is_file():
        return saved.read_text().strip()
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_run_name(args, run_id: str) -> str | None:
    """`--wandb-group` plus `_<run id>`, so runs of one group differ and a resumed run keeps its name; the group
    alone under `--disable-wandb-random-suffix`. None without a group: `WANDB_NAME`, else wandb's random name."""
    if not args.wandb_group:
        return None
    return args.wandb_group if args.disable_wandb_random_suffix else f"{args.wandb_group}_{run_id}"


def init_wandb(args, start_rollout_id: int):
    """Start (or, resuming, continue) the wandb run; unset flags leave wandb its `WANDB_*` variables.

    Raises:
        RuntimeError: wandb refused to start (e.g. online without an API key), with the fix.
    """
    import wandb

    run_id = wandb_run_id(args, start_rollout_id)
    if args.wandb_dir:
        os.makedirs(args.wandb_dir, exist_ok=True)  # wandb falls back to a temporary folder without it
    # The key goes to wandb's login only: neither it nor the engines' key goes into the config or the command line
    # (sys.argv), both of which wandb stores with the run.
    credentials = {"api_key": args.wandb_key, "base_url": args.wandb_host}
    argv = sys.argv
    for secret in (args.wandb_key, engine_api_key(args)):
        if secret:
            sys.argv = [arg.replace(secret, "<redacted>") for arg in sys.argv]
    try:
        run = wandb.init(
            project=args.wandb_project or os.environ.get("WANDB_PROJECT") or "slime",
            entity=args.wandb_team,
            group=args.wandb_group,
            name=wandb_run_name(args, run_id),
            dir=args.wandb_dir,
            mode=args.wandb_mode,
            id=run_id,
            resume=None if os.environ.get("WANDB_RESUME") else "allow",
            config=run_config(args),
            settings=wandb.Settings(**{k: v for k, v in credentials.items() if v is not None}),
        )
    except wandb.errors.UsageError as error:
        raise RuntimeError(
            f"--use-wandb: wandb did not start: {error} Log in with --wandb-key (or WANDB_API_KEY, or `wandb login`), "
            "or keep the run local with --wandb-mode offline (upload it later with `wandb sync`)"
        ) from error
    finally:
        sys.argv = argv
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.save) / WANDB_RUN_ID_FILE, run.id + "\n")
    return run


def run_config(args) -> dict:
    """`args` as the trackers store them: without the wandb key, and with the engine and router keys masked."""
    config = {k: v for k, v in vars(args).items() if k != "wandb_key"}
    if config.get("sglang_api_key"):
        config["sglang_api_key"] = "<redacted>"
    for name in ("sglang_server_args", "router_args"):
        options = config.get(name)
        if isinstance(options, dict) and ({"api_key", "api-key"} & options.keys()):
            config[name] = {k: "<redacted>" if k in ("api_key", "api-key") else v for k, v in options.items()}
    return config


def tensorboard_dir(args) -> str:
    """`--tensorboard-dir`, else `TENSORBOARD_DIR`, else `tensorboard_log/<--tb-project-name>/<--tb-experiment-name>`
    (defaults: `slime` and the start time, so runs do not mix)."""
    if args.tensorboard_dir:
        return args.tensorboard_dir
    if os.environ.get("TENSORBOARD_DIR"):
        return os.environ["TENSORBOARD_DIR"]
    experiment = args.tb_experiment_name or time.strftime("%Y%m%d_%H%M%S")
    return os.path.join("tensorboard_log", args.tb_project_name or "slime", experiment)


class Tracker:
    """Sends metrics to every enabled sink and keeps a JSONL history under `--save` (or nowhere).

    The history holds one row per rollout: metrics logged twice for a rollout (eval before training,
    then training) are merged into its row, and a resumed run drops the rows of the rollouts it redoes.
    wandb gets the same row at step `rollout_id`, with `rollout/step` (= rollout_id) and `train/step`
    (optimizer steps before this rollout) as x axes: `train/*` and `critic/*` are plotted against
    `train/step`, the rest against `rollout/step` (everything against `train/step` with
    `--wandb-always-use-train-step`). TensorBoard gets every number at step `rollout_id`.

    Args:
        args: Parsed arguments (sinks, `--save`).
        start_rollout_id: The first rollout this run logs; rows from it on, left by an earlier run that
            stopped before checkpointing them, are dropped.
    """

    def __init__(self, args, start_rollout_id: int = 0):
        self.wandb = None
        self.tensorboard = None
        self.history_path: Path | None = None
        self.last_row: dict[str, Any] | None = None
        self.ci = CIChecks(args) if args.ci_test else None
        if args.use_wandb:
            self.wandb = init_wandb(args, start_rollout_id)
            self.wandb_defined: set[str] = set()
            self.wandb_all_on_train_step = args.wandb_always_use_train_step
            self.steps_per_rollout = args.num_steps_per_rollout
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = tensorboard_dir(args)
            logger.info("TensorBoard logs go to %s", log_dir)
            self.tensorboard = SummaryWriter(log_dir=log_dir)
        if args.save:
            self.history_path = Path(args.save) / "metrics.jsonl"
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            if self.history_path.exists():
                self._keep_rows_before(start_rollout_id)

    def _rows(self) -> list[dict[str, Any]]:
        rows = []
        for number, line in enumerate(self.history_path.read_text().splitlines(), start=1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a row cut short when the earlier run was killed
                logger.warning("%s line %d is not JSON; dropping it", self.history_path, number)
        return rows

    def _write_rows(self, rows: list[dict[str, Any]]) -> None:
        atomic_write_text(self.history_path, "".join(json.dumps(row) + "\n" for row in rows))

    def _keep_rows_before(self, start_rollout_id: int) -> None:
        rows = self._rows()
        kept = [row for row in rows if isinstance(row.get("rollout_id"), int) and row["rollout_id"] < start_rollout_id]
        if len(kept) != len(self.history_path.read_text().splitlines()):
            logger.info(
                "%s: dropping the rows of rollouts >= %d, which this run redoes", self.history_path, start_rollout_id
            )
            self._write_rows(kept)

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        """Print and record one row; then run the `--ci-test` checks (a failing row is on record first).

        Raises:
            CICheckFailed: under `--ci-test`, a checked metric crossed its threshold.
        """
        self._write(rollout_id, metrics)
        if self.ci is not None:
            self.ci.on_log(rollout_id, metrics)

    def _write(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        logger.info(format_step_line(rollout_id, metrics))
        if self.wandb is not None:
            self._log_wandb(rollout_id, metrics)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, numbers.Real):
                    self.tensorboard.add_scalar(key, value, rollout_id)
            self.tensorboard.flush()
        if self.history_path is None:
            return
        if self.last_row is not None and self.last_row["rollout_id"] == rollout_id:
            self.last_row = {**self.last_row, **metrics}  # same rollout again: one row, rewritten whole
            self._write_rows(self._rows()[:-1] + [self.last_row])
            return
        self.last_row = {"rollout_id": rollout_id, **metrics}
        with self.history_path.open("a") as f:
            f.write(json.dumps(self.last_row) + "\n")

    def _log_wandb(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        for key in metrics.keys() - self.wandb_defined:
            on_train_step = self.wandb_all_on_train_step or key.startswith(TRAIN_PREFIXES)
            self.wandb.define_metric(key, step_metric="train/step" if on_train_step else "rollout/step")
            self.wandb_defined.add(key)
        # A rollout logged twice (eval, then training) stays one wandb row: same step.
        axes = {"rollout/step": rollout_id, "train/step": rollout_id * self.steps_per_rollout}
        self.wandb.log({**metrics, **axes}, step=rollout_id)

    def finish(self) -> None:
        """Close the sinks; under `--ci-test` fail when the checked metric never reached its threshold."""
        if self.ci is not None:
            self.ci.on_finish()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
