"""examples/retool: code extraction, code runs in the sandbox (a misbehaving block becomes an error message), the
boxed-answer reward, and a train.py run in which a tiny model taught one trajectory runs code and answers."""

import asyncio
import json
import sys
from argparse import Namespace

import pytest
from support.runs import REPO, run_training, saved_samples, small_run_flags
from support.tiny_model import teach_tiny_model
from transformers import AutoTokenizer

from slime.agent.sandbox import SandboxLimits
from slime.utils.types import Sample, Status

EXAMPLE = REPO / "examples" / "retool"
sys.path.insert(0, str(EXAMPLE))
import generate_with_retool  # noqa: E402


def test_code_is_extracted_from_tags_tool_calls_and_fences():
    extract = generate_with_retool.extract_code
    assert extract("Let me compute. <code>\n    x = 12 * 34\n    print(x)\n</code>") == "x = 12 * 34\nprint(x)"
    assert extract("<code>```python\nprint(1)\n```</code>") == "print(1)"
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(2)"}}</tool_call>'
    assert extract("I will run it. " + call) == "print(2)"
    assert extract("```python\nprint(3)\n```\nand then\n```py\nprint(4)\n```") == "print(4)"
    assert extract("<code>print(5)</code> <code>print(6)</code>") == "print(6)"
    assert extract("The answer is \\boxed{408}.") is None
    assert extract("<code>print(7)") is None  # cut off before its closing tag
    assert extract("```bash\nls\n```") is None
    other_tool = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    assert extract(other_tool) is None


def interpret(code: str, **limits) -> str:
    return asyncio.run(generate_with_retool.interpreter(code, SandboxLimits(**limits)))


def test_the_interpreter_returns_what_the_code_printed():
    assert interpret("print(12 * 34)") == "\n<interpreter>\n408\n</interpreter>\n"


@pytest.mark.slow
@pytest.mark.reliability(
    "retool code that raises, loops forever or prints without end",
    "an interpreter message ending in an Error: line for the model, never an exception in the rollout",
)
def test_misbehaving_code_becomes_an_interpreter_error_message():
    raised = interpret("print('partial')\n1 / 0")
    assert raised.startswith("\n<interpreter>\npartial\nError: ") and "ZeroDivisionError" in raised
    looped = interpret("while True:\n    pass", wall_time_s=1.0, cpu_time_s=1.0)
    assert "Error: " in looped and looped.endswith("</interpreter>\n")
    flood = interpret("while True:\n    print('x' * 1000)", max_output_bytes=512, wall_time_s=5.0)
    body = flood.removeprefix("\n<interpreter>\n").removesuffix("\n</interpreter>\n")
    assert "Error: " in body and len(body.encode()) <= 512


def test_reward_grades_the_last_boxed_answer_the_model_wrote():
    args = Namespace(rm_num_workers=1, rm_timeout_secs=5)

    def reward(response: str, label: str) -> float:
        return asyncio.run(generate_with_retool.reward_func(args, Sample(index=0, response=response, label=label)))

    assert (
        reward("<code>print(1/2)</code>\n<interpreter>\n0.5\n</interpreter>\nSo it is \\boxed{\\frac{1}{2}}.", "0.5")
        == 1.0
    )
    assert reward("First \\boxed{3}, no: \\boxed{4}", "4") == 1.0
    assert reward("\\boxed{407}", "408") == 0.0
    assert reward("no box: 408", "408") == 0.0
    # A box in the code, or printed by it, is not the model's answer.
    assert reward("<code>print('\\\\boxed{408}')</code>\n<interpreter>\n\\boxed{408}\n</interpreter>\n", "408") == 0.0


@pytest.mark.slow
def test_train_py_runs_code_and_answers(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))
    row = json.loads((EXAMPLE / "math.jsonl").read_text().splitlines()[0])
    assert row["label"] == "408"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    code = "<code>print(12 * 34)</code>"
    output = "\n<interpreter>\n408\n</interpreter>\n"
    answer = "The answer is \\boxed{408}.<|im_end|>"
    model = teach_tiny_model(tiny_model_dir, tmp_path / "model", [(prompt, 0), (code, 1), (output, 0), (answer, 1)])
    data = tmp_path / "math.jsonl"
    data.write_text((json.dumps(row) + "\n") * 2)
    save = tmp_path / "run"
    history = run_training(
        "train.py", save, *small_run_flags(model, data, save), "--num-rollout", "2",
        "--custom-generate-function-path", "generate_with_retool.generate",
        "--custom-rm-path", "generate_with_retool.reward_func",
        "--max-turns", "2", "--rollout-max-response-len", "32", "--rollout-temperature", "0.1",
    )  # fmt: skip
    assert [h["rollout_id"] for h in history] == [0, 1] and [h["rollout/reward"] for h in history] == [1.0, 1.0]
    assert all(h["train/train_rollout_logprob_max_abs_diff"] <= 1e-4 for h in history)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    expected_mask = [1] * len(ids(code)) + [0] * len(ids(output)) + [1] * len(ids(answer))
    for rollout_id in (0, 1):
        samples = saved_samples(save, rollout_id)
        assert len(samples) == 4
        for s in samples:
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
            # Turn 1 stops at </code>, the sandbox's output goes in masked out, turn 2 ends at the EOS.
            assert tokenizer.decode(s.tokens[-s.response_length :]) == code + output + answer
            assert s.loss_mask == expected_mask and s.status == Status.COMPLETED
            assert s.reward == 1.0 and s.metadata["tool_calls"] == 1
