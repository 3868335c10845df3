"""Per-step metrics: one printed line per rollout, plus wandb / TensorBoard when enabled."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

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
    """Sends metrics to every enabled sink and keeps a JSONL history under `--save` (or nowhere)."""

    def __init__(self, args):
        self.wandb = None
        self.tensorboard = None
        self.history_path: Path | None = None
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

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        logger.info(format_step_line(rollout_id, metrics))
        if self.wandb is not None:
            self.wandb.log({**metrics, "rollout_id": rollout_id}, step=rollout_id)
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, rollout_id)
            self.tensorboard.flush()
        if self.history_path is not None:
            with self.history_path.open("a") as f:
                f.write(json.dumps({"rollout_id": rollout_id, **metrics}) + "\n")

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
