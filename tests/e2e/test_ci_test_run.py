"""A --ci-test train.py run whose checked metric misses its threshold."""

from __future__ import annotations

import json

import pytest


@pytest.mark.reliability(
    "a --ci-test train.py run whose checked metric stays below its threshold",
    "the real first-step KL / log-prob checks pass, the run exits non-zero naming the metric",
)
def test_ci_test_run_fails_when_the_checked_metric_misses(tiny_model_dir, tmp_path):
    from support.runs import run_driver_script, small_run_flags, write_addition_prompts

    prompts = write_addition_prompts(tmp_path / "prompts.jsonl")
    flags = small_run_flags(tiny_model_dir, prompts, tmp_path / "run") + ["--num-rollout", "1", "--ci-test"]
    flags += ["--ci-metric-checker-key", "rollout/reward", "--ci-metric-checker-threshold", "2.0"]  # rewards <= 1
    result = run_driver_script("train.py", *flags, timeout=400)
    last_line = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0, result.stderr[-3000:]
    assert last_line.startswith("slime: CICheckFailed: --ci-test: rollout/reward never reached"), last_line
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train/ppo_kl"] == 0.0 and "train/train_rollout_logprob_abs_diff" in rows[0]
