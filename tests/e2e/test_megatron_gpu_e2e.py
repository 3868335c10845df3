"""train.py with the Megatron trainer and SGLang engines on a GPU: two rollouts, weight sync, resume.

Skipped without CUDA (the `gpu` marker). The model is the tiny random Llama of tests/support/tiny_model.py,
or a real HF folder given by SLIME_TEST_HF_MODEL (e.g. Qwen2.5-0.5B-Instruct) for a meaningful run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_e2e_data") / "train.jsonl"
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_megatron_sglang_two_rollouts(tiny_model_dir, prompt_file, tmp_path):
    pytest.importorskip("sglang")
    pytest.importorskip("megatron.core")
    model_dir = os.environ.get("SLIME_TEST_HF_MODEL") or str(tiny_model_dir)
    command = [
        sys.executable, "train.py",
        "--train-backend", "megatron", "--rollout-backend", "sglang",
        "--hf-checkpoint", model_dir,
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate",
        "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.4",
        "--prompt-data", str(prompt_file), "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
        "--rm-type", "random", "--rollout-shuffle",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "16",
        "--global-batch-size", "8", "--micro-batch-size", "2",
        "--num-rollout", "2", "--lr", "1e-5", "--use-kl-loss", "--kl-loss-coef", "0.01",
        "--save", str(tmp_path), "--save-interval", "1", "--check-weight-update-equal",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    history = [h for h in history if "rollout/reward" in h]
    assert [h["rollout_id"] for h in history] == [0, 1]
    # bf16 engine vs fp32 trainer: log-probs agree loosely; the first KL to the reference is exactly 0.
    assert history[0]["train/train_rollout_logprob_abs_diff"] < 0.1
    assert history[0]["train/kl_loss"] == 0.0
    assert history[1]["train/train_rollout_logprob_abs_diff"] < 0.1
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
