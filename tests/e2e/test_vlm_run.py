"""examples/geo3k_vlm on CPU: its data synthesizer's prompts through `train.py` on a tiny random Qwen2.5-VL, two
rollouts. The engine's log-probs of rollout 0 (sampled from the weights the trainer starts from) must equal the
trainer's within 1e-4, images and M-RoPE positions included; the saved samples carry their images, the expanded
prompt and the trainer's image inputs."""

from __future__ import annotations

import json
import subprocess
import sys

from support.runs import REPO, run_training, saved_samples, small_run_flags


def test_train_py_trains_a_vision_language_model(tmp_path, tiny_vlm_dir):
    model = tiny_vlm_dir
    data = tmp_path / "geo3k_synth"
    subprocess.run(
        [sys.executable, "examples/geo3k_vlm/synth_data.py", "--out", str(data), "--train", "8", "--test", "2",
         "--size", "56"],
        cwd=REPO, check=True,
    )  # fmt: skip
    save = tmp_path / "run"
    rows = run_training(
        "train.py", save, *small_run_flags(model, data / "train.jsonl", save),
        "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
        "--num-rollout", "2", "--custom-rm-path", "support.rewards.alternating_reward",
    )  # fmt: skip
    assert len(rows) == 2
    assert rows[0]["train/train_rollout_logprob_max_abs_diff"] <= 1e-4, rows[0]
    samples = saved_samples(save, 0)
    image_id = json.loads((model / "config.json").read_text())["image_token_id"]
    assert samples and all(len(s.multimodal_inputs["images"]) == 1 for s in samples)
    for s in samples:
        grid = s.multimodal_train_inputs["image_grid_thw"]
        assert grid.shape == (1, 3) and s.multimodal_train_inputs["pixel_values"].shape[0] == int(grid.prod())
        assert s.tokens[: s.prompt_length].count(image_id) == int(grid.prod()) // 4
