"""examples/train_infer_mismatch_helper: mis.py against hand-computed values and mis.yaml through the parser. The
train.py run with mis.yaml (finite, healthy mismatch metrics) rides on the PPO run of tests/e2e/test_train_e2e.py."""

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from slime.utils.arguments import parse_args

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_infer_mismatch_helper"
sys.path.insert(0, str(EXAMPLE))
import mis  # noqa: E402

# Two samples; r = pi_train / pi_rollout per token. B's second token is not trainable (e.g. tool output).
RATIOS = [[1.5, 3.0, 0.25], [0.8, 0.01]]
MASKS = [[1, 1, 1], [1, 0]]
ROLLOUT_LOG_PROBS = [[-1.0, -2.0, -0.5], [-0.3, -1.2]]


def run_mis(**settings):
    args = Namespace(tis_clip=2.0, **settings)
    rollout = [torch.tensor(lp) for lp in ROLLOUT_LOG_PROBS]
    train = [r + torch.tensor(ratios).log() for r, ratios in zip(rollout, RATIOS)]
    pg_loss = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    weighted, masks, metrics = mis.mis_function(
        args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
        loss_masks=[torch.tensor(m) for m in MASKS], total_lengths=[6, 5], response_lengths=[3, 2],
    )  # fmt: skip
    return weighted, [m.tolist() for m in masks], {k: float(v) for k, v in metrics.items()}


def test_token_level_masks_out_of_bounds_tokens_and_truncates_the_rest():
    weighted, masks, metrics = run_mis(mis_level="token", mis_lower_bound=0.5, mis_upper_bound=2.0)
    # Kept: 1.5 (A) and 0.8 (B); 3.0 and 0.25 are out of [0.5, 2]; B's 0.01 is not trainable anyway.
    assert masks == [[1, 0, 0], [1, 0]]
    # Weights min(r, 2): 1.5, 2, 0.25, 0.8, 0.01 times the per-token loss 1..5.
    assert weighted.tolist() == pytest.approx([1.5, 4.0, 0.75, 3.2, 0.05], rel=1e-5)
    assert metrics["mis_ratio_mean"] == pytest.approx((1.5 + 3.0 + 0.25 + 0.8) / 4, rel=1e-5)
    assert metrics["mis_masked_fraction"] == pytest.approx(2 / 4)
    assert metrics["mis_veto_fraction"] == 0.0 and metrics["tis_clipfrac"] == 0.0


def test_sequence_level_masks_whole_samples_by_their_product():
    _, masks, metrics = run_mis(mis_level="sequence", mis_lower_bound=0.5, mis_upper_bound=1.1)
    # A: 1.5 * 3 * 0.25 = 1.125 > 1.1, dropped whole; B: 0.8 (its trainable token only), kept.
    assert masks == [[0, 0, 0], [1, 0]]
    assert metrics["mis_ratio_mean"] == pytest.approx((3 * 1.125 + 0.8) / 4, rel=1e-5)
    assert metrics["mis_masked_fraction"] == pytest.approx(3 / 4)


def test_geometric_level_keeps_by_the_per_token_mean_and_counts_truncated_weights():
    _, masks, metrics = run_mis(mis_level="geometric", mis_lower_bound=0.9, mis_upper_bound=1.1)
    # A: 1.125 ** (1/3) = 1.040, kept; B: 0.8 < 0.9, dropped.
    assert masks == [[1, 1, 1], [0, 0]]
    assert metrics["mis_ratio_mean"] == pytest.approx((3 * 1.125 ** (1 / 3) + 0.8) / 4, rel=1e-5)
    # A's 3.0 is kept and its weight cut to tis_clip = 2: one of the four trainable tokens.
    assert metrics["tis_clipfrac"] == pytest.approx(1 / 4) and metrics["mis_masked_fraction"] == pytest.approx(1 / 4)


def test_veto_drops_a_sample_with_one_tiny_trainable_ratio():
    _, masks, metrics = run_mis(mis_level="token", mis_lower_bound=0.1, mis_upper_bound=10.0, mis_veto_threshold=0.3)
    # A holds 0.25 < 0.3: vetoed whole. B's 0.01 is below too, but not trainable, so B stays.
    assert masks == [[0, 0, 0], [1, 0]]
    assert metrics["mis_veto_fraction"] == pytest.approx(3 / 4) and metrics["mis_masked_fraction"] == pytest.approx(
        3 / 4
    )


def test_defaults_apply_without_settings():
    _, masks, _ = run_mis()  # token level, [0.5, 2.0], no veto
    assert masks == [[1, 0, 0], [1, 0]]


@pytest.mark.reliability("mis.py settings out of range or written as a string", "ValueError naming the mis_* key")
@pytest.mark.parametrize(
    "settings, message",
    [
        ({"mis_level": "batch"}, "mis_level is 'batch'; use token, sequence or geometric"),
        ({"mis_lower_bound": 3.0, "mis_upper_bound": 2.0}, r"mis_lower_bound \(3.0\) and mis_upper_bound \(2.0\)"),
        ({"mis_veto_threshold": "1e-4"}, "mis_veto_threshold is '1e-4', not a number; write it as e.g. 0.5 or 1.0e-4"),
        ({"mis_veto_threshold": 0.0}, "mis_veto_threshold is 0.0; use a ratio > 0"),
    ],
)
def test_bad_settings_name_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        run_mis(**settings)


def test_mis_yaml_sets_the_flags_and_the_mis_keys(tiny_model_dir, tmp_path):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1 + 2?", "label": "3"}) + "\n")
    args = parse_args([
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts), "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--custom-config-path", str(EXAMPLE / "mis.yaml"),
    ])  # fmt: skip
    assert (args.use_tis, args.custom_tis_function_path, args.tis_clip, args.get_mismatch_metrics) == (
        True,
        "mis.mis_function",
        2.0,
        True,
    )
    assert mis.MisConfig.from_args(args) == mis.MisConfig(level="token", lower=0.5, upper=2.0, veto_threshold=1e-4)
