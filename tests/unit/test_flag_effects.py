"""Flags shown at work in the pure function that reads them: each test parses a command line and asserts what the
value changes (sampling params, eval settings, record fields, optimizer and schedule, losses, advantages, layouts,
CI checks, parse-time errors). slime/utils/arguments/flag_tests.py names these tests for their flags."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from slime.algorithms.advantages import compute_advantages_and_returns
from slime.algorithms.aggregation import StepNormalizer
from slime.algorithms.losses import policy_loss_from_log_probs, value_loss
from slime.backends.fsdp_utils.model import build_lr_scheduler, build_optimizer
from slime.ray.actor_group import data_parallel_ranks
from slime.ray.rollout import samples_to_train_data
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sglang_rollout import sampling_params_from_args
from slime.utils.arguments import ArgumentValidationError, parse_args
from slime.utils.data import load_dataset
from slime.utils.eval_config import eval_datasets
from slime.utils.perf import device_peak_tflops
from slime.utils.ppo_utils import vanilla_tis_function
from slime.utils.tracking import CICheckFailed, Tracker
from slime.utils.types import Sample, Status

BASE = [
    "--hf-checkpoint", "/models/tiny",
    "--prompt-data", "/data/train.jsonl",
    "--rollout-batch-size", "2",
    "--n-samples-per-prompt", "2",
    "--num-rollout", "3",
]  # fmt: skip


def args_with(*extra: str):
    return parse_args([*BASE, *extra])


# ---- sampling and evaluation settings ---------------------------------------------------------------------------


def test_sampling_flags_are_the_engine_sampling_params():
    args = args_with(
        "--rollout-temperature", "0.7", "--rollout-top-p", "0.9", "--rollout-top-k", "20",
        "--rollout-max-response-len", "48", "--rollout-skip-special-tokens", "--rollout-stop", "###", "END",
        "--rollout-stop-token-ids", "7", "11",
        "--eval-temperature", "0.1", "--eval-top-p", "0.5", "--eval-top-k", "3", "--eval-max-response-len", "96",
        "--eval-min-new-tokens", "4",
    )  # fmt: skip
    train = sampling_params_from_args(args)
    assert (train["temperature"], train["top_p"], train["top_k"], train["max_new_tokens"]) == (0.7, 0.9, 20, 48)
    assert train["skip_special_tokens"] is True and "min_new_tokens" not in train
    assert train["stop"] == ["###", "END"] and train["stop_token_ids"] == [7, 11]
    evaluation = sampling_params_from_args(args, evaluation=True)
    assert (evaluation["temperature"], evaluation["top_p"], evaluation["top_k"]) == (0.1, 0.5, 3)
    assert (evaluation["max_new_tokens"], evaluation["min_new_tokens"]) == (96, 4)
    assert evaluation["stop"] == ["###", "END"]  # the stop flags hold in evaluation too
    plain = sampling_params_from_args(args_with("--rollout-max-response-len", "48"))
    assert (plain["temperature"], plain["top_p"], plain["top_k"], plain["skip_special_tokens"]) == (1.0, 1.0, -1, False)
    assert "stop" not in plain and "stop_token_ids" not in plain


def test_eval_flags_fill_in_each_eval_set():
    args = args_with(
        "--eval-prompt-data", "aime", "/e/aime.jsonl", "--rollout-max-prompt-len", "128", "--reward-key", "acc",
        "--eval-input-key", "problem", "--eval-label-key", "answer", "--eval-tool-key", "functions",
        "--eval-reward-key", "score", "--eval-max-prompt-len", "512",
    )  # fmt: skip
    (aime,) = eval_datasets(args)
    assert (aime.input_key, aime.label_key, aime.tool_key) == ("problem", "answer", "functions")
    assert (aime.reward_key, aime.max_prompt_len) == ("score", 512)
    (fallback,) = eval_datasets(args_with("--eval-prompt-data", "aime", "/e/aime.jsonl", "--reward-key", "acc"))
    assert (fallback.input_key, fallback.label_key, fallback.tool_key) == ("input", None, "tools")
    assert fallback.reward_key == "acc"  # without --eval-reward-key, the training key


def test_metadata_and_tool_keys_name_the_record_fields(tmp_path):
    tools = [{"name": "calculator"}]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"input": "hi", "meta": {"level": 2}, "functions": tools, "metadata": {"x": 1}}) + "\n")
    (sample,) = load_dataset(str(path), args_with("--metadata-key", "meta", "--tool-key", "functions")).samples
    assert sample.metadata == {"level": 2, "tools": tools}
    (default,) = load_dataset(str(path), args_with()).samples
    assert default.metadata == {"x": 1}  # the default keys: "metadata", and no "tools" field in the record


def test_start_rollout_id_that_misses_the_data_source_warns(tmp_path, caplog):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"p{i}"}) + "\n" for i in range(4)))
    flags = ["--prompt-data", str(prompts), "--save", str(tmp_path / "run"), "--load", str(tmp_path / "run")]
    RolloutDataSource(args_with(*flags)).save(1)
    for start, warns in (("2", False), ("5", True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="slime.rollout.data_source"):
            RolloutDataSource(args_with(*flags, "--start-rollout-id", start)).load(1)
        assert ("--start-rollout-id is 5" in caplog.text) == warns


# ---- optimizer and learning-rate schedule -----------------------------------------------------------------------


def test_adam_flags_build_the_optimizer():
    model = torch.nn.Linear(3, 2)
    args = args_with("--lr", "3e-4", "--adam-beta1", "0.8", "--adam-beta2", "0.95", "--adam-eps", "1e-6",
                     "--weight-decay", "0.05")  # fmt: skip
    (group,) = build_optimizer(args, model).param_groups
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.05)
    with pytest.raises(ValueError, match="--optimizer adam only"):
        build_optimizer(args_with("--optimizer", "sgd"), model)


def learning_rates(args, num_steps: int) -> list[float]:
    optimizer = build_optimizer(args, torch.nn.Linear(2, 1))
    scheduler = build_lr_scheduler(args, optimizer)
    rates = []
    for _ in range(num_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_lr_flags_shape_the_schedule():
    common = ("--lr", "1e-3", "--min-lr", "1e-4")
    assert learning_rates(args_with(*common), 3) == [1e-3] * 3  # constant by default
    warm = learning_rates(args_with(*common, "--lr-warmup-iters", "2", "--lr-decay-style", "linear",
                                    "--lr-decay-iters", "6"), 8)  # fmt: skip
    assert warm == pytest.approx(
        [5e-4, 1e-3, 1e-3, 1e-3 - 0.9e-3 / 4, 1e-3 - 0.9e-3 / 2, 1e-3 - 2.7e-3 / 4, 1e-4, 1e-4]
    )
    # --lr-warmup-fraction of the decay length (here --num-rollout 3 x 1 step): 2 of 3 steps, then cosine to min.
    cosine = learning_rates(args_with(*common, "--lr-warmup-fraction", "0.67", "--lr-decay-style", "cosine"), 4)
    assert cosine == pytest.approx([5e-4, 1e-3, 1e-3, 1e-4])


# ---- losses and advantages --------------------------------------------------------------------------------------


def policy_batch(old: list[float], advantages: list[float], ref: list[float] | None = None) -> dict:
    batch = {
        "log_probs": [torch.tensor(old)],
        "advantages": [torch.tensor(advantages)],
        "loss_masks": [torch.ones(len(old))],
        "response_lengths": [len(old)],
        "total_lengths": [len(old) + 2],
    }
    return batch | ({"ref_log_probs": [torch.tensor(ref)]} if ref is not None else {})


def test_eps_clip_bounds_the_ratio_from_below():
    # ratio 0.5 on a negative advantage: clipped at 1 - eps_clip, the loss is -A x max(0.5, 1 - eps_clip).
    log_probs, batch = torch.tensor([math.log(0.5)]), policy_batch([0.0], [-1.0])
    for eps_clip, expected in (("0.2", 0.8), ("0.6", 0.5)):
        args = args_with("--eps-clip", eps_clip)
        loss, _ = policy_loss_from_log_probs(args, batch, log_probs, torch.zeros(1), StepNormalizer(1, 1))
        assert loss.item() == pytest.approx(expected)


def test_kl_and_entropy_flags_change_the_policy_loss():
    # Ratio 1 (log_probs == old) on advantage 0: the surrogate is 0; only the KL and entropy terms remain.
    current = torch.tensor([-1.0, -2.0])
    batch, normalizer = policy_batch([-1.5, -2.0], [0.0, 0.0], ref=[-1.25, -2.5]), StepNormalizer(1, 2)
    kl = (current - torch.tensor([-1.25, -2.5])).mean().item()  # k1 = log_probs - ref, seq-mean-token-mean
    entropy = torch.tensor([0.5, 1.5])

    def loss_of(*extra: str) -> float:
        return policy_loss_from_log_probs(args_with(*extra), batch, current, entropy, normalizer)[0].item()

    base = loss_of()
    assert loss_of("--use-kl-loss", "--kl-loss-coef", "0.5") == pytest.approx(base + 0.5 * kl)
    ratio = (current - torch.tensor([-1.5, -2.0])).exp()  # importance ratio to the generating policy
    unbiased = (ratio * (current - torch.tensor([-1.25, -2.5]))).mean().item()
    assert loss_of("--use-kl-loss", "--kl-loss-coef", "0.5", "--use-unbiased-kl") == pytest.approx(
        base + 0.5 * unbiased
    )
    log_ratio = current - torch.tensor([-1.25, -2.5])
    k2 = (log_ratio**2 / 2).mean().item()
    assert loss_of("--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", "k2") == pytest.approx(base + 0.5 * k2)
    assert loss_of("--entropy-coef", "0.1") == pytest.approx(base - 0.1 * 1.0)


def test_value_clip_bounds_the_critic_update():
    batch = {"values": [torch.tensor([0.0])], "returns": [torch.tensor([2.0])], "loss_masks": [torch.ones(1)],
             "response_lengths": [1]}  # fmt: skip
    new_values = torch.tensor([1.0])
    # max((1 - 2)^2, (0 + clamp(1, -c, c) - 2)^2) / 2: c = 0.2 -> (1.8^2) / 2; c = 5 -> 1 / 2.
    for clip, expected in (("0.2", 1.8**2 / 2), ("5", 0.5)):
        loss, _ = value_loss(args_with("--value-clip", clip), batch, new_values, StepNormalizer(1, 1))
        assert loss.item() == pytest.approx(expected)


def test_tis_clip_low_floors_the_importance_weights():
    train, rollout = [torch.tensor([-2.0, 0.0])], [torch.tensor([0.0, 0.0])]  # weights exp(train - rollout)

    def weights(*extra: str) -> list[float]:
        weighted, _, _ = vanilla_tis_function(
            args_with("--use-tis", *extra), pg_loss=torch.ones(2), train_log_probs=train,
            rollout_log_probs=rollout, loss_masks=[torch.ones(2, dtype=torch.long)], total_lengths=[4], response_lengths=[2],
        )  # fmt: skip
        return weighted.tolist()

    assert weights("--tis-clip", "2") == pytest.approx([math.exp(-2.0), 1.0])
    assert weights("--tis-clip", "2", "--tis-clip-low", "0.5") == pytest.approx([0.5, 1.0])


def test_gamma_and_lambd_discount_the_ppo_advantages():
    def advantages(*extra: str) -> list[float]:
        data = {"rewards": [1.0], "loss_masks": [torch.ones(2)], "values": [torch.tensor([0.5, 0.25])]}
        compute_advantages_and_returns(args_with("--advantage-estimator", "ppo", *extra), data)
        return data["advantages"][0].tolist()

    # Reward 1 on the last token. gamma = lambd = 1: A_1 = 1 - 0.25, A_0 = 0.25 - 0.5 + A_1.
    assert advantages() == pytest.approx([0.5, 0.75])
    # gamma = lambd = 0.5: delta_0 = 0.5 x 0.25 - 0.5, A_0 = delta_0 + 0.25 x A_1.
    assert advantages("--gamma", "0.5", "--lambd", "0.5") == pytest.approx([-0.375 + 0.25 * 0.75, 0.75])


def test_kl_coef_takes_the_kl_out_of_the_token_rewards():
    def returns(*extra: str) -> list[float]:
        data = {"rewards": [1.0], "loss_masks": [torch.ones(2)], "log_probs": [torch.tensor([-1.0, -1.0])],
                "ref_log_probs": [torch.tensor([-1.5, -1.0])]}  # fmt: skip
        compute_advantages_and_returns(args_with("--advantage-estimator", "reinforce_plus_plus", *extra), data)
        return data["returns"][0].tolist()

    assert returns() == pytest.approx([1.0, 1.0])
    # k1 KL per token [0.5, 0]: token rewards [-0.5 x 0.5, 1], summed from the end.
    assert returns("--kl-coef", "0.5") == pytest.approx([0.75, 1.0])


def test_grpo_std_normalization_can_be_turned_off():
    samples = [
        Sample(index=i, group_index=0, tokens=[1, 2, 3], response_length=1, reward=r, status=Status.COMPLETED)
        for i, r in enumerate([3.0, 1.0])
    ]
    std = math.sqrt(2.0)  # unbiased std of [3, 1]
    assert samples_to_train_data(args_with(), samples)["rewards"] == pytest.approx([1 / std, -1 / std])
    off = samples_to_train_data(args_with("--disable-grpo-std-normalization"), samples)
    assert off["rewards"] == pytest.approx([1.0, -1.0])  # the group mean only


# ---- layouts and parse-time checks ------------------------------------------------------------------------------


def test_context_parallel_size_groups_the_data_parallel_ranks():
    megatron = ["--train-backend", "megatron"]
    assert data_parallel_ranks(args_with(*megatron), 4) == [0, 1, 2, 3]
    # Ranks in one context-parallel group share a data-parallel rank (and so a shard of the rollout).
    assert data_parallel_ranks(args_with(*megatron, "--context-parallel-size", "2"), 4) == [0, 0, 1, 1]


def test_megatron_precision_and_parallel_flags_reach_the_config():
    pytest.importorskip("megatron.core")
    from slime.backends.megatron_utils.config import transformer_config_from_args

    model = ["--train-backend", "megatron", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64"]  # fmt: skip
    assert transformer_config_from_args(args_with(*model)).params_dtype == torch.float32
    bf16 = transformer_config_from_args(args_with(*model, "--bf16"))
    assert (bf16.params_dtype, bf16.bf16, bf16.fp16) == (torch.bfloat16, True, False)
    fp16 = transformer_config_from_args(args_with(*model, "--fp16"))
    assert (fp16.params_dtype, fp16.bf16, fp16.fp16) == (torch.float16, False, True)
    moe = ["--num-experts", "4", "--disable-bias-linear", "--tensor-model-parallel-size", "2"]
    parallel = transformer_config_from_args(
        args_with(*model, *moe, "--expert-model-parallel-size", "2", "--sequence-parallel")
    )
    assert (parallel.expert_model_parallel_size, parallel.sequence_parallel) == (2, True)
    plain = transformer_config_from_args(args_with(*model, *moe))
    assert (plain.expert_model_parallel_size, plain.sequence_parallel) == (1, False)


def test_an_engine_wider_than_a_node_is_refused():
    sglang = ["--rollout-backend", "sglang", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4"]
    assert parse_args([*BASE, *sglang, "--num-gpus-per-node", "4"]).rollout_num_engines == 1
    with pytest.raises(ArgumentValidationError, match="--num-gpus-per-node"):
        parse_args([*BASE, *sglang, "--num-gpus-per-node", "2"])


# ---- logging and CI checks --------------------------------------------------------------------------------------


def test_ci_logprob_gap_threshold_is_the_flag():
    gap = {"train/train_rollout_logprob_abs_diff": 0.2}
    with pytest.raises(CICheckFailed, match="exceeds --ci-train-rollout-logprob-abs-diff-threshold"):
        Tracker(args_with("--ci-test")).log(1, gap)
    Tracker(args_with("--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold", "0.25")).log(1, gap)
    with pytest.raises(CICheckFailed, match="0.2 exceeds"):
        Tracker(args_with("--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold", "0.15")).log(1, gap)


def test_peak_tflops_overrides_the_device_peak():
    assert device_peak_tflops(args_with("--peak-tflops", "123.5").peak_tflops) == 123.5
    assert device_peak_tflops(args_with().peak_tflops) == device_peak_tflops(None)
