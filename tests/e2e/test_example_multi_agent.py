"""examples/multi_agent: the reviewer turn's text, the reward on the final answer, and a train.py run with it."""

import asyncio
import sys

import pytest
from support.chat_templates import use_llama3_template
from support.flags import slime_flags
from support.runs import REPO, run_training, saved_samples, small_run_flags, write_addition_prompts
from transformers import AutoTokenizer

from slime.rollout.rm_hub.last_number import compute_last_number_reward
from slime.utils.types import Sample

EXAMPLE = REPO / "examples" / "multi_agent"
sys.path.insert(0, str(EXAMPLE))
import agent_system  # noqa: E402

MESSAGE = "You are the reviewer. The solver answered: 7\nCheck the solution, correct it if it is wrong, and end with the final answer."


def test_reviewer_message_quotes_the_solver_answer():
    assert agent_system.reviewer_message("  7\n") == MESSAGE


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def turn_text(tokenizer, solver_text: str, end_token: str = "") -> str:
    """The reviewer turn after a solver answer `solver_text` (+ `end_token` when the solver stopped on it)."""
    solver_ids = tokenizer.encode(solver_text, add_special_tokens=False)
    if end_token:
        solver_ids.append(tokenizer.convert_tokens_to_ids(end_token))
    return tokenizer.decode(agent_system.reviewer_turn_ids(tokenizer, solver_ids, " 7\n"))


def test_reviewer_turn_follows_the_chatml_layout(tokenizer):
    # The tiny template writes "<|im_start|>{role}\n{content}<|im_end|>\n" per message.
    user_turn = f"<|im_start|>user\n{MESSAGE}<|im_end|>\n<|im_start|>assistant\n"
    assert turn_text(tokenizer, "so 7") == "<|im_end|>\n" + user_turn  # cut by length: the template ends the turn
    assert turn_text(tokenizer, "so 7", "<|im_end|>") == "\n" + user_turn  # the solver's EOS ended it


def test_reviewer_turn_follows_the_llama3_layout(tiny_model_dir):
    llama = use_llama3_template(AutoTokenizer.from_pretrained(tiny_model_dir))
    expected = f"<|start_header_id|>user<|end_header_id|>\n\n{MESSAGE}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert turn_text(llama, "so 7", "<|eot_id|>") == expected
    assert turn_text(llama, "so 7") == "<|eot_id|>" + expected


@pytest.mark.reliability(
    "multi-agent example on a template that drops assistant turns, or none", "ValueError naming the template"
)
def test_reviewer_turn_refuses_templates_it_cannot_follow(tiny_model_dir):
    dropping = AutoTokenizer.from_pretrained(tiny_model_dir)
    dropping.chat_template = "{% for m in messages if m['role'] != 'assistant' %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="does not render an assistant message's content"):
        turn_text(dropping, "so 7")
    dropping.chat_template = None
    with pytest.raises(ValueError, match="chat template rejected the messages: .*chat_template is not set"):
        turn_text(dropping, "so 7")


@pytest.mark.reliability("multi-agent example with --max-turns 1", "ValueError: it takes two model turns")
def test_generate_needs_two_turns():
    with pytest.raises(ValueError, match="two model turns \\(solver, reviewer\\); --max-turns is 1"):
        asyncio.run(agent_system.generate(slime_flags(max_turns=1), Sample(index=0, prompt="1 + 1"), {}))


def test_reward_grades_the_final_answer_and_records_the_solver_one():
    args = slime_flags(rm_type=None, custom_rm_path="agent_system.reward_func")
    fixed = Sample(index=0, label="7", metadata={"solver_answer": "3 + 4 = 8", "final_answer": "no, 3 + 4 = 7"})
    assert asyncio.run(agent_system.reward_func(args, fixed)) == 1.0 and fixed.metadata["solver_reward"] == 0.0
    broken = Sample(index=1, label="7", metadata={"solver_answer": "7", "final_answer": "7 + 1 = 8"})
    assert asyncio.run(agent_system.reward_func(args, broken)) == 0.0 and broken.metadata["solver_reward"] == 1.0
    # --rm-type picks the grader: f1 scores word overlap, so a partly right answer gets a partial score.
    f1_args = slime_flags(rm_type="f1", custom_rm_path="agent_system.reward_func")
    partial = Sample(index=2, label="paris france", metadata={"solver_answer": "", "final_answer": "paris"})
    assert asyncio.run(agent_system.reward_func(f1_args, partial)) == pytest.approx(2 * 1 * 0.5 / 1.5)


@pytest.mark.reliability(
    "multi-agent reward_func on a sample its generate did not make", "ValueError naming the generate flag"
)
def test_reward_refuses_samples_from_another_generate():
    args = slime_flags(rm_type=None, custom_rm_path="agent_system.reward_func")
    with pytest.raises(ValueError, match="--custom-generate-function-path agent_system.generate"):
        asyncio.run(agent_system.reward_func(args, Sample(index=4, label="7", response="7")))


@pytest.mark.slow
def test_train_py_trains_on_solver_and_reviewer_turns(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))
    prompts = write_addition_prompts(tmp_path / "train.jsonl")
    save = tmp_path / "run"
    history = run_training(
        "train.py", save, *small_run_flags(tiny_model_dir, prompts, save), "--num-rollout", "2",
        "--custom-generate-function-path", "agent_system.generate", "--custom-rm-path", "agent_system.reward_func",
    )  # fmt: skip
    assert [h["rollout_id"] for h in history] == [0, 1] and all("train/loss" in h for h in history)
    # The trainer recomputes the sampled tokens' log-probs on the one-trajectory sequence: they match the
    # engines' only if the reviewer saw exactly that sequence (prompt, solver answer, reviewer turn).
    assert all(h["train/train_rollout_logprob_max_abs_diff"] <= 1e-4 for h in history)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for rollout_id in (0, 1):
        samples = saved_samples(save, rollout_id)
        assert len(samples) == 4  # n_samples_per_prompt samples per prompt: GRPO groups stay whole
        for s in samples:
            assert tokenizer.decode(s.tokens[: -s.response_length]) == s.prompt  # templated by the data source
            response, mask, log_probs = s.tokens[-s.response_length :], s.loss_mask, s.rollout_log_probs
            assert len(mask) == len(log_probs) == s.response_length
            # Mask layout: solver tokens (1), the reviewer turn (0), reviewer tokens (1).
            solver_end = mask.index(0)
            reviewer_start = solver_end + mask[solver_end:].index(1)
            assert 0 < solver_end and all(mask[reviewer_start:]) and mask[0] == 1
            solver, turn, reviewer = (
                response[:solver_end],
                response[solver_end:reviewer_start],
                response[reviewer_start:],
            )
            ended = solver[-1] == tokenizer.eos_token_id
            answer = tokenizer.decode(solver, skip_special_tokens=True)
            quoted = f"You are the reviewer. The solver answered: {answer.strip()}\n"
            expected = f"{'' if ended else '<|im_end|>'}\n<|im_start|>user\n{quoted}"
            assert tokenizer.decode(turn).startswith(expected) and tokenizer.decode(turn).endswith(
                "<|im_end|>\n<|im_start|>assistant\n"
            )
            # Sampled tokens carry the engine's log-probs; the written turn none.
            assert all(lp < 0 for lp in log_probs[:solver_end] + log_probs[reviewer_start:])
            assert all(lp == 0 for lp in log_probs[solver_end:reviewer_start])
            final = tokenizer.decode(reviewer, skip_special_tokens=True)
            assert s.metadata["solver_answer"] == answer and s.metadata["final_answer"] == final
            assert s.reward == compute_last_number_reward(final, s.label)
            assert s.metadata["solver_reward"] == compute_last_number_reward(answer, s.label)
