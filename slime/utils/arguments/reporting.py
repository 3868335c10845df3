"""What a run reports and checks: wandb / tensorboard logging, extra metrics, and the --ci-* checks."""

from __future__ import annotations

import argparse


def _add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument("--use-wandb", action="store_true")
    group.add_argument("--wandb-mode", choices=["online", "offline", "disabled"], default=None)
    group.add_argument("--wandb-dir", default=None)
    group.add_argument("--wandb-key", default=None)
    group.add_argument("--wandb-host", default=None)
    group.add_argument("--wandb-team", default=None)
    group.add_argument("--wandb-group", default=None)
    group.add_argument("--wandb-run-id", default=None)
    group.add_argument("--disable-wandb-random-suffix", action="store_true", help="Use --wandb-group as run name.")
    group.add_argument(
        "--wandb-always-use-train-step", action="store_true", help="Log every metric against the train step."
    )
    group.add_argument("--log-multi-turn", action="store_true", help="Log multi-turn statistics.")
    group.add_argument(
        "--log-passrate", action="store_true", help="Log pass@k over each prompt group (a reward >= 1 passes)."
    )
    group.add_argument("--log-reward-category", default=None, help="Metadata key to break rewards down by.")
    group.add_argument("--log-correct-samples", action="store_true", help="Log statistics of correct samples.")
    group.add_argument("--use-tensorboard", action="store_true")
    group.add_argument("--tb-project-name", default=None)
    group.add_argument("--tb-experiment-name", default=None)


def _add_ci_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("CI")
    group.add_argument(
        "--ci-test",
        action="store_true",
        help="Fail the run when a checked metric crosses its threshold: ppo_kl and kl_loss exactly 0 on the first "
        "rollout (when it has one optimizer step), the train/rollout log-prob gap, and the --ci-* checks below.",
    )
    group.add_argument("--ci-disable-kl-checker", action="store_true", help="Skip the first-rollout KL == 0 check.")
    group.add_argument(
        "--ci-train-rollout-logprob-abs-diff-threshold",
        type=float,
        default=0.1,
        help="Largest allowed train/train_rollout_logprob_abs_diff (mean |train - rollout| log-prob) per rollout.",
    )
    group.add_argument(
        "--ci-save-grad-norm", default=None, help="Write each rollout's train/grad_norm to this {rollout_id} template."
    )
    group.add_argument(
        "--ci-load-grad-norm",
        default=None,
        help="Compare each rollout's train/grad_norm with the one saved at this {rollout_id} template (1%% tolerance).",
    )
    group.add_argument(
        "--ci-metric-checker-key", default=None, help="Metric that must reach the threshold, e.g. eval/gsm8k."
    )
    group.add_argument(
        "--ci-metric-checker-threshold",
        type=float,
        default=None,
        help="The run fails at its end unless some logged value of --ci-metric-checker-key is at least this.",
    )
