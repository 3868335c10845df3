"""Per-step metrics: one printed line per rollout, plus wandb / TensorBoard when enabled, and the `--ci-test`
checks on them."""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any

from slime.utils.atomic_dir import atomic_write_text

logger = logging.getLogger("slime")

# (metric key, label, format) of the per-rollout line, in print order; missing keys are skipped.
STEP_LINE_FIELDS = (
    ("rollout/reward", "reward", "{:.3f}"),
    ("train/kl_loss", "kl", "{:.4f}"),
    ("train/ppo_kl", "ppo_kl", "{:.4f}"),
    ("train/loss", "loss", "{:.4f}"),
    ("train/grad_norm", "grad_norm", "{:.3f}"),
    ("rollout/response_length", "resp_len", "{:.1f}"),
    ("rollout/truncated", "truncated", "{:.2f}"),
    ("rollout/tokens_per_s", "rollout_tok/s", "{:.1f}"),
    ("train/tokens_per_s", "train_tok/s", "{:.1f}"),
    ("perf/step_time", "step_time", "{:.1f}s"),
)


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


def format_step_line(rollout_id: int, metrics: dict[str, float]) -> str:
    """`rollout 3 | reward 0.412 | kl 0.0012 | loss -0.0101 | ... | step_time 41.2s | eval_math 0.350`."""
    parts = [f"rollout {rollout_id}"]
    for key, label, fmt in STEP_LINE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    for key, value in sorted(metrics.items()):
        if key.startswith("eval/") and key.count("/") == 1:  # eval/<set name>: that set's mean reward
            parts.append(f"eval_{key[5:]} {value:.3f}")
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


def _wandb_run_name(args) -> str | None:
    """`--wandb-group` plus a random suffix, so runs of one group differ (unless `--disable-wandb-random-suffix`)."""
    if not args.wandb_group:
        return None
    return args.wandb_group if args.disable_wandb_random_suffix else f"{args.wandb_group}_{uuid.uuid4().hex[:6]}"


class Tracker:
    """Sends metrics to every enabled sink and keeps a JSONL history under `--save` (or nowhere).

    The history holds one row per rollout: metrics logged twice for a rollout (eval before training,
    then training) are merged into its row, and a resumed run drops the rows of the rollouts it redoes.

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
        self.ci = CIChecks(args) if getattr(args, "ci_test", False) else None
        # --wandb-always-use-train-step: wandb's x axis is the optimizer step, not the rollout
        use_train_step = getattr(args, "wandb_always_use_train_step", False)
        self.wandb_steps_per_rollout = args.num_steps_per_rollout if use_train_step else 1
        if args.use_wandb:
            import wandb

            if args.wandb_key or args.wandb_host:
                wandb.login(key=args.wandb_key, host=args.wandb_host, relogin=bool(args.wandb_key))
            self.wandb = wandb.init(
                project=args.wandb_project or "slime",
                entity=args.wandb_team,
                group=args.wandb_group,
                name=_wandb_run_name(args),
                dir=args.wandb_dir,
                mode=args.wandb_mode,
                id=args.wandb_run_id,
                resume="allow" if args.wandb_run_id else None,
                config={k: v for k, v in vars(args).items() if k != "wandb_key"},  # never upload the key
            )
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = args.tensorboard_dir or os.path.join(
                "tensorboard", args.tb_project_name or "slime", args.tb_experiment_name or "run"
            )
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
            step = rollout_id * self.wandb_steps_per_rollout
            self.wandb.log({**metrics, "rollout_id": rollout_id, "train/step": step}, step=step)
        if self.tensorboard is not None:
            for key, value in metrics.items():
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

    def finish(self) -> None:
        """Close the sinks; under `--ci-test` fail when the checked metric never reached its threshold."""
        if self.ci is not None:
            self.ci.on_finish()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
