"""Debug modes and dumps: rollout-only / train-only runs, saved rollout and train data."""

from __future__ import annotations

import argparse


def _add_debug_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("debug")
    group.add_argument("--debug-rollout-only", action="store_true", help="Start only the engines, no trainer.")
    group.add_argument("--debug-train-only", action="store_true", help="Start only the trainer, no engines.")
    group.add_argument(
        "--save-debug-rollout-data",
        default=None,
        help="Save each rollout's data to this path template, e.g. /tmp/rollout_{rollout_id}.pt.",
    )
    group.add_argument(
        "--load-debug-rollout-data",
        default=None,
        help="Train on saved rollout data from this path template instead of generating; implies --debug-train-only.",
    )
    group.add_argument(
        "--load-debug-rollout-data-subsample",
        type=float,
        default=None,
        help="Fraction of the loaded rollout data to keep.",
    )
    group.add_argument(
        "--save-debug-train-data",
        default=None,
        help="Save each data-parallel rank's train data to this {rollout_id} {rank} path template.",
    )
    group.add_argument("--dump-details", default=None, help="Directory for detailed per-step dumps.")
    group.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        help="After the first weight push, compare engine weights with the trainer's.",
    )
    group.add_argument("--http-proxy", default=None, help="Proxy for HTTP calls made by reward functions.")
    group.add_argument("--use-distributed-post", action="store_true", help="Spread HTTP posts over Ray workers.")
