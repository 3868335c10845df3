"""--true-on-policy-mode: the CPU engine and the FSDP trainer compute bit-identical log-probs for the same weights
and tokens, so train/train_rollout_logprob_abs_diff is exactly 0 and the first step's ppo_kl is exactly 0. The same
rollout without the mode (decode-time log-probs, shared-prompt rows) shows a gap, so the zero means something."""

from __future__ import annotations

import pytest
from support.engines import cpu_engine_process
from support.fsdp import make_args, new_actor

PROMPTS = [[5, 17, 42, 99, 123, 7], [250, 31, 64, 12, 200]]

pytestmark = pytest.mark.usefixtures("destroy_process_group_after_module")


def engine_rollout(client, samples_per_prompt: int = 2) -> dict:
    """Train data of sampled responses with the engine's log-probs, two samples per prompt."""
    tokens, response_lengths, rollout_log_probs = [], [], []
    for prompt in PROMPTS:
        for seed in range(samples_per_prompt):
            answer = client.generate(
                {
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True,
                                        "sampling_seed": seed},
                    "return_logprob": True,
                }
            )  # fmt: skip
            tokens.append(prompt + answer["output_ids"])
            response_lengths.append(len(answer["output_ids"]))
            rollout_log_probs.append([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    rewards = [1.0, -1.0] * (len(tokens) // 2)
    return {
        "tokens": tokens,
        "response_lengths": response_lengths,
        "rewards": rewards,
        "raw_reward": list(rewards),
        "truncated": [1] * len(tokens),
        "loss_masks": [[1] * n for n in response_lengths],
        "rollout_log_probs": rollout_log_probs,
        "sample_indices": list(range(len(tokens))),
        "num_steps": 1,
    }


@pytest.mark.parametrize("true_on_policy", [True, False], ids=["on", "off"])
def test_engine_and_trainer_log_probs_are_bit_identical(tiny_model_dir, true_on_policy):
    mode = ["--true-on-policy-mode"] if true_on_policy else []
    args = make_args(tiny_model_dir, "--lr", "1e-2", *mode, num_samples=4)
    engine_flags = ["--true-on-policy-threads", str(args.train_num_threads)] if true_on_policy else []
    with cpu_engine_process(tiny_model_dir, *engine_flags) as (client, _):
        data = engine_rollout(client)
    metrics = new_actor(args).train(0, data)
    gap, kl = metrics["train/train_rollout_logprob_abs_diff"], metrics["train/ppo_kl"]
    print(f"true on-policy {true_on_policy}: |train - rollout| {gap:.3e}, first-step ppo_kl {kl:.3e}")
    if true_on_policy:
        assert gap == 0.0 and metrics["train/train_rollout_logprob_max_abs_diff"] == 0.0
        assert kl == 0.0
    else:
        assert gap > 0.0
