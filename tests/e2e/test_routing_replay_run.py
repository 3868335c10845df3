"""train.py --use-rollout-routing-replay on Megatron end to end."""

from __future__ import annotations

import pytest
import torch
from support.moe import NUM_LAYERS, TOP_K, hf_routing


@pytest.mark.slow
def test_train_py_with_routing_replay(moe_dir, tmp_path):
    """`python train.py --use-rollout-routing-replay` on Megatron: Ray, a CPU engine process; the default rollout asks
    the engine for the routing, the samples carry it, the trainer replays it. (The rollout side does not depend on
    the backend, and the tests above cover FSDP's actor; Megatron's run also pushes its per-expert HF names into the
    engine's fused experts.)"""
    from support.runs import run_training, saved_samples, small_run_flags, write_addition_prompts

    flags = small_run_flags(moe_dir, write_addition_prompts(tmp_path / "prompts.jsonl"), tmp_path / "save")
    rows = run_training(
        "train.py", tmp_path / "save", *flags, "--num-rollout", "1", "--train-backend", "megatron",
        "--use-rollout-routing-replay",
    )  # fmt: skip
    assert rows and rows[0]["train/train_rollout_logprob_max_abs_diff"] < 1e-4  # a float32 engine: rounding only
    samples = saved_samples(tmp_path / "save", 0)
    assert len(samples) == 4
    for sample in samples:
        assert sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, NUM_LAYERS, TOP_K)
        expected = hf_routing(moe_dir, sample.tokens)[: len(sample.tokens) - 1]
        torch.testing.assert_close(sample.rollout_routed_experts.long(), expected.long())
