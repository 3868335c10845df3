"""What a run reports and checks: wandb / tensorboard logging, extra metrics, and the --ci-* checks."""

from __future__ import annotations

import argparse


def _add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    # Unset wandb / TensorBoard flags fall back to the tools' own environment variables (named in each help).
    group.add_argument("--use-wandb", action="store_true", help="Log every rollout's metrics to Weights & Biases.")
    group.add_argument(
        "--wandb-mode",
        choices=["online", "offline", "disabled"],
        default=None,
        help="online; offline: write the run under --wandb-dir only (upload it later with `wandb sync`); disabled: "
        "log nothing. Unset: WANDB_MODE, else online.",
    )
    group.add_argument(
        "--wandb-dir", default=None, help="Folder of wandb's run files. Unset: WANDB_DIR, else the working directory."
    )
    group.add_argument(
        "--wandb-key",
        default=None,
        help="API key to log in with; never stored in the run's config. Unset: WANDB_API_KEY, else `wandb login`'s.",
    )
    group.add_argument(
        "--wandb-host",
        default=None,
        help="URL of the W&B server (e.g. a self-hosted one). Unset: WANDB_BASE_URL, else https://api.wandb.ai.",
    )
    group.add_argument(
        "--wandb-team", default=None, help="wandb entity (team or user). Unset: WANDB_ENTITY, else the key's default."
    )
    group.add_argument(
        "--wandb-group",
        default=None,
        help="wandb group; the run is named <group>_<run id>. Unset: WANDB_RUN_GROUP (the run name then WANDB_NAME "
        "or a random one). The project is --wandb-project (unset: WANDB_PROJECT, else slime).",
    )
    group.add_argument(
        "--wandb-run-id",
        default=None,
        help="Log into this wandb run, continuing it if it exists. Unset: WANDB_RUN_ID, else (resuming from --load) "
        "the run the saved run logged into (its --save/wandb_run_id.txt), else a new run.",
    )
    group.add_argument(
        "--disable-wandb-random-suffix", action="store_true", help="Name the wandb run --wandb-group alone."
    )
    group.add_argument(
        "--wandb-always-use-train-step",
        action="store_true",
        help="Plot every wandb metric against train/step (optimizer steps); by default only train/* and critic/* "
        "are, the rest against rollout/step.",
    )
    group.add_argument("--log-multi-turn", action="store_true", help="Log multi-turn statistics.")
    group.add_argument(
        "--log-passrate", action="store_true", help="Log pass@k over each prompt group (a reward >= 1 passes)."
    )
    group.add_argument("--log-reward-category", default=None, help="Metadata key to break rewards down by.")
    group.add_argument("--log-correct-samples", action="store_true", help="Log statistics of correct samples.")
    group.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="Peak TFLOPs of one training device, the denominator of perf/actor_train_mfu. Default: the dense BF16 "
        "peak of a known GPU (H100/H200: 989), on CPU the FP32 peak of the trainer's threads from /proc/cpuinfo.",
    )
    group.add_argument(
        "--use-tensorboard",
        action="store_true",
        help="Write every rollout's metrics as TensorBoard scalars to --tensorboard-dir, else TENSORBOARD_DIR, else "
        "tensorboard_log/<--tb-project-name>/<--tb-experiment-name>.",
    )
    group.add_argument("--tb-project-name", default=None, help="TensorBoard project folder (default: slime).")
    group.add_argument(
        "--tb-experiment-name", default=None, help="TensorBoard run folder (default: the start time, YYYYmmdd_HHMMSS)."
    )


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
