"""Per-step metrics: one printed line per rollout, plus wandb / TensorBoard when enabled."""

from __future__ import annotations

import json
import logging
import os
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
        if args.use_wandb:
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project or "slime",
                group=args.wandb_group,
                dir=args.wandb_dir,
                mode=args.wandb_mode,
                id=args.wandb_run_id,
                resume="allow" if args.wandb_run_id else None,
                config=vars(args),
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
        logger.info(format_step_line(rollout_id, metrics))
        if self.wandb is not None:
            self.wandb.log({**metrics, "rollout_id": rollout_id}, step=rollout_id)
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
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
