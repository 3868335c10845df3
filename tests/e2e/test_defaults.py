"""Only the required flags: every default must work, from the command line to a trained step.

One end-to-end `train.py` run with the minimum a user must pass, plus in-process checks of the defaults it
relies on (sampling params, reward key, the rollout's context arithmetic).
"""

import asyncio
import json
from pathlib import Path

import pytest
from support.runs import run_driver_script, write_addition_prompts

from slime.ray.rollout import rollout_metrics, samples_to_train_data
from slime.rollout import sglang_rollout
from slime.rollout.rm_hub import async_rm
from slime.rollout.sglang_rollout import generate, sampling_params_from_args
from slime.utils.arguments import parse_args
from slime.utils.async_utils import run
from slime.utils.types import Sample, Status


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_addition_prompts(tmp_path_factory.mktemp("defaults_data") / "train.jsonl", range(1, 4))


def required_flags(model_dir, prompt_file) -> list[str]:
    """What a user cannot leave out: model, prompts and their keys, a reward, the batch and the run length."""
    return [
        "--hf-checkpoint", str(model_dir),
        "--prompt-data", str(prompt_file), "--input-key", "prompt", "--label-key", "label",
        "--rm-type", "last_number",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "2",
    ]  # fmt: skip


@pytest.fixture
def fresh_rollout_state(monkeypatch):
    """The default rollout keeps one state per process; give each test its own."""
    monkeypatch.setattr(sglang_rollout, "_STATE", None)


def context_length(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]


def test_train_py_runs_with_only_the_required_flags(tiny_model_dir, prompt_file):
    # As a new user runs it: train.py alone, starting its own local Ray cluster.
    result = run_driver_script("train.py", *required_flags(tiny_model_dir, prompt_file), timeout=300, own_cluster=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"train.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    # Both rollouts were generated and trained on (the step line carries the trainer's loss).
    steps = [line for line in output.splitlines() if "slime: rollout " in line and "| loss " in line]
    assert [line.split("slime: rollout ")[1].split(" |")[0] for line in steps] == ["0", "1"]


def test_unset_response_length_means_up_to_the_context(tiny_model_dir, prompt_file):
    # SGLang refuses prompt + max_new_tokens >= its context length: the most a request may reach is one less.
    limit = context_length(tiny_model_dir) - 1
    args = parse_args(required_flags(tiny_model_dir, prompt_file))
    assert sampling_params_from_args(args)["max_new_tokens"] == limit
    assert sampling_params_from_args(args, evaluation=True)["max_new_tokens"] == limit

    args = parse_args(
        [
            *required_flags(tiny_model_dir, prompt_file),
            "--rollout-max-context-len",
            "100",
            "--eval-max-context-len",
            "50",
        ]
    )
    assert sampling_params_from_args(args)["max_new_tokens"] == 100
    assert sampling_params_from_args(args, evaluation=True)["max_new_tokens"] == 50
    args = parse_args([*required_flags(tiny_model_dir, prompt_file), "--rollout-max-response-len", "8"])
    assert sampling_params_from_args(args)["max_new_tokens"] == 8


def test_partial_response_that_fills_the_context_is_truncated(tiny_model_dir, prompt_file, fresh_rollout_state):
    """A partial rollout continued without --rollout-max-response-len: no room left, so no request at all."""
    args = parse_args([*required_flags(tiny_model_dir, prompt_file), "--partial-rollout"])
    limit = context_length(tiny_model_dir) - 1
    sample = Sample(index=0, prompt="What is 1 + 1?", tokens=[5] * limit, response="x" * 500, response_length=500)
    sample.status = Status.ABORTED
    # No router is running: reaching the network would fail, so the sample must come back untouched.
    sample = run(generate(args, sample, sampling_params_from_args(args)))
    assert sample.status == Status.TRUNCATED and sample.response_length == 500


@pytest.mark.reliability("prompt longer than the context limit", "ValueError naming --rollout-max-prompt-len")
def test_prompt_longer_than_the_context_is_refused_by_name(tiny_model_dir, prompt_file, fresh_rollout_state):
    args = parse_args([*required_flags(tiny_model_dir, prompt_file), "--rollout-max-context-len", "6"])
    sample = Sample(index=3, prompt="What is 1 + 1? " * 10)
    with pytest.raises(ValueError, match=r"sample 3: the prompt has \d+ tokens.*--rollout-max-prompt-len"):
        run(generate(args, sample, sampling_params_from_args(args)))


def test_dapo_reward_needs_no_reward_key(tiny_model_dir, prompt_file):
    flags = required_flags(tiny_model_dir, prompt_file)
    flags[flags.index("last_number")] = "dapo"
    args = parse_args([*flags, "--n-samples-per-prompt", "2"])
    samples = []
    for i, response in enumerate(["Answer: 2", "Answer: 3"]):
        sample = Sample(index=i, group_index=0, tokens=[1, 2, 3], response=response, response_length=1, label="2")
        sample.reward, sample.status = asyncio.run(async_rm(args, sample)), Status.COMPLETED
        samples.append(sample)
    assert isinstance(samples[0].reward, dict)  # dapo scores {"score", "acc", "pred"}
    assert rollout_metrics(samples, args.reward_key, 1.0)["rollout/reward"] == pytest.approx(0.0)  # (1 + -1) / 2
    assert samples_to_train_data(args, samples)["raw_reward"] == [1.0, -1.0]
