"""An SFT run of train.py on CPU: the loss falls on the assistant turns only."""

from __future__ import annotations

import json

import pytest
from support.runs import run_driver_script
from support.sft import CONVERSATION, initial_sft_loss, write_conversations
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_train_py_sft_run_learns_the_assistant_turns(tiny_model_dir, tokenizer, tmp_path):
    messages = CONVERSATION[:5]
    data = write_conversations(tmp_path / "sft.jsonl", [{"messages": messages}] * 8)
    save = tmp_path / "run"
    result = run_driver_script(
        "train.py", "--hf-checkpoint", str(tiny_model_dir),
        "--prompt-data", str(data), "--input-key", "messages", "--rollout-shuffle",
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--rollout-batch-size", "2", "--global-batch-size", "2", "--num-rollout", "4",
        "--loss-type", "sft_loss", "--calculate-per-token-loss", "--disable-compute-advantages-and-returns",
        "--debug-train-only", "--lr", "1e-2", "--save", str(save),
        "--rollout-data-postprocess-path", "support.sft.refuse_advantages",
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    history = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert len(losses) == 4
    # One optimizer step per rollout: the first rollout's loss is the untrained model's, on assistant tokens only.
    assert losses[0] == pytest.approx(initial_sft_loss(tiny_model_dir, tokenizer, messages), rel=1e-4)
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses
