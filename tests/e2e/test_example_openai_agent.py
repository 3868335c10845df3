"""examples/openai_agent: the calculator and tool messages, the agent's three branches (no number, tool call,
answer) against a real engine through the trajectory proxy, and a train.py run with `--agent-function-path`."""

import asyncio
import re
import shutil
import sys

import pytest
import torch
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from support.engines import cpu_engine_process
from support.flags import slime_flags
from support.runs import REPO, run_training, saved_samples, small_run_flags, write_addition_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime.agent.chat_turns import continuation_ids, prompt_ids
from slime.rollout import agent_rollout
from slime.rollout.rm_hub.last_number import compute_last_number_reward
from slime.utils.types import Sample, Status

EXAMPLE = REPO / "examples" / "openai_agent"
sys.path.insert(0, str(EXAMPLE))
import agent  # noqa: E402
import reward  # noqa: E402


@pytest.mark.parametrize(
    "expression, value",
    [("12 + 34", "46"), ("(2 + 3) * 4 - 6 / 3", "18"), ("7 / 2", "3.5"), ("-3 * -2", "6"), ("1 / 3", "0.3333333333")],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert agent.calculate(expression) == value


@pytest.mark.reliability(
    "the model sends the calculator code, powers, bad syntax, a huge expression, x / 0",
    "an 'error: ...' tool result the model reads; nothing is run as code",
)
def test_calculator_refuses_everything_else():
    assert agent.calculate("__import__('os').getcwd()").startswith("error: only numbers, + - * / and parentheses")
    assert (
        agent.calculate("2 ** 100000") == "error: only numbers, + - * / and parentheses are allowed, not '2 ** 100000'"
    )
    assert agent.calculate("12 +") == "error: '12 +' is not an arithmetic expression"
    assert agent.calculate("1" * 201) == "error: the expression is longer than 200 characters"
    assert agent.calculate("1 / (2 - 2)") == "error: division by zero"


@pytest.mark.reliability(
    "the model calls an unknown tool or sends arguments that are not JSON", "an 'error: ...' tool result naming the fix"
)
def test_tool_calls_become_tool_messages():
    call = ChatCompletionMessageFunctionToolCall(
        id="call_1", type="function", function={"name": "calculator", "arguments": '{"expression": "6 * 7"}'}
    )
    assert agent.tool_message(call) == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    assert agent.run_tool("search", "{}") == "error: there is no tool 'search'; the only tool is calculator"
    bad_arguments = 'error: the arguments must be a JSON object like {"expression": "12 + 34"}'
    assert agent.run_tool("calculator", "6 * 7") == bad_arguments
    assert agent.run_tool("calculator", '{"expr": "6 * 7"}') == bad_arguments


def test_final_answer_first_messages_and_reward():
    assert agent.final_answer(" The answer is 46. ") == "The answer is 46."
    assert agent.final_answer("I am not sure.") is None and agent.final_answer(None) is None
    assert agent.first_messages("What is 1 + 2?") == [
        {"role": "system", "content": agent.SYSTEM_PROMPT},
        {"role": "user", "content": "What is 1 + 2?"},
    ]
    right = Sample(label="46", response="<tool_call>... 46 ... 45", metadata={"agent_answer": "The answer is 46."})
    assert asyncio.run(reward.reward_func(None, right)) == 1.0
    # The last number of the whole response is 46, but the agent gave no answer.
    assert asyncio.run(reward.reward_func(None, Sample(label="46", response="46"))) == 0.0


# ---- the agent against a model taught its three branches ------------------------------------------------------
QUESTION = "What is 12 + 34?"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 34"}}</tool_call>'
REPLIES = ["I am not sure.", CALL, "The answer is 46."]


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model fitted to one session: no number, then (after the reminder) a calculator call, then (after
    the tool result 46) the answer. Its tokens are laid out as the proxy lays them out."""
    path = tmp_path_factory.mktemp("tool_model")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    follow_ups = [[{"role": "user", "content": agent.REMINDER}], [{"role": "tool", "content": "46"}]]
    ids = prompt_ids(tokenizer, agent.first_messages(QUESTION), [agent.CALCULATOR_TOOL])
    labels = [-100] * len(ids)
    for i, text in enumerate(REPLIES):
        output = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids, labels = ids + output, labels + output
        if i < len(follow_ups):
            context = continuation_ids(tokenizer, output, follow_ups[i], [agent.CALCULATOR_TOOL])
            ids, labels = ids + context, labels + [-100] * len(context)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(60):  # the loss is below 0.01 after about 50 steps
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


@pytest.mark.slow
def test_agent_reminds_calls_the_tool_and_answers_through_the_proxy(tool_model_dir):
    args = slime_flags(
        agent_function_path="agent.run", max_turns=8, hf_checkpoint=str(tool_model_dir), trust_remote_code=False,
        sglang_api_key=None, sglang_router_request_timeout_secs=60, rollout_max_context_len=None,
    )  # fmt: skip
    # top_k 1: the model's most likely tokens, with log-probs of its whole distribution (temperature 1).
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 1, "max_new_tokens": 96}

    async def one_session(engine_url):
        args.rollout_engine_urls = [engine_url]
        sample = await agent_rollout.generate(args, Sample(index=0, prompt=QUESTION, label="46"), sampling)
        await (await agent_rollout.get_proxy(args)).stop()
        return sample

    with cpu_engine_process(tool_model_dir) as (_, url):
        sample = asyncio.run(one_session(url))

    assert sample.status == Status.COMPLETED and sample.metadata["agent_answer"] == "The answer is 46."
    assert asyncio.run(reward.reward_func(args, sample)) == 1.0
    # Three model turns (mask 1) between the context the agent added (mask 0): the reminder after the reply
    # without a number, then the calculator's result for the expression the model wrote.
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    response = sample.tokens[-sample.response_length :]
    runs = [(m, [t for t, _ in group]) for m, group in _runs(zip(response, sample.loss_mask))]
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    texts = [tokenizer.decode(ids) for _, ids in runs]
    assert texts[0::2] == [reply + "<|im_end|>" for reply in REPLIES]
    assert texts[1] == f"\n<|im_start|>user\n{agent.REMINDER}<|im_end|>\n<|im_start|>assistant\n"
    assert texts[3] == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"


def _runs(pairs):
    """Consecutive (token, mask) pairs grouped by mask value: [(mask, [(token, mask), ...]), ...]."""
    groups: list = []
    for token, mask in pairs:
        if groups and groups[-1][0] == mask:
            groups[-1][1].append((token, mask))
        else:
            groups.append((mask, [(token, mask)]))
    return groups


# ---- train.py -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_py_trains_on_agent_sessions(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLE))
    prompts = write_addition_prompts(tmp_path / "train.jsonl")
    save = tmp_path / "run"
    # The agent sends chat messages and the proxy templates them: the prompts stay plain text.
    flags = [flag for flag in small_run_flags(tiny_model_dir, prompts, save) if flag != "--apply-chat-template"]
    history = run_training(
        "train.py", save, *flags, "--num-rollout", "2",
        "--agent-function-path", "agent.run", "--custom-rm-path", "reward.reward_func",
    )  # fmt: skip
    assert [h["rollout_id"] for h in history] == [0, 1] and all("train/loss" in h for h in history)
    # The trainer's log-probs of the sampled tokens match the engine's: the session is trained token for token.
    assert all(h["train/train_rollout_logprob_max_abs_diff"] <= 1e-4 for h in history)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reminder = f"\n<|im_start|>user\n{agent.REMINDER}<|im_end|>\n<|im_start|>assistant\n"
    for rollout_id in (0, 1):
        samples = saved_samples(save, rollout_id)
        assert len(samples) == 4
        for s in samples:
            first = agent.first_messages(s.prompt)
            prompt = tokenizer.apply_chat_template(
                first, tools=[agent.CALCULATOR_TOOL], add_generation_prompt=True, tokenize=False
            )
            assert tokenizer.decode(s.tokens[: s.prompt_length]) == prompt
            response = s.tokens[-s.response_length :]
            runs = _runs(zip(response, s.loss_mask))
            turns = [tokenizer.decode([t for t, _ in group], skip_special_tokens=True) for m, group in runs if m]
            # An untrained model never writes a tool call: each reply without a number gets the reminder, up to
            # MAX_TURNS replies; the first reply with a number is the answer.
            assert 1 <= len(turns) <= agent.MAX_TURNS and [m for m, _ in runs] == [1, 0] * (len(turns) - 1) + [1]
            context = [group for m, group in runs if not m]
            # A reply cut by length lacks <|im_end|>, which the template then writes first.
            assert all(tokenizer.decode([t for t, _ in group]).endswith(reminder) for group in context)
            assert not any(re.search(r"\d", text) for text in turns[:-1])
            answer = s.metadata.get("agent_answer")
            if answer is None:
                assert len(turns) == agent.MAX_TURNS and not re.search(r"\d", turns[-1])
            else:
                assert answer == turns[-1].strip()
            assert s.reward == compute_last_number_reward(answer or "", s.label)
            assert s.status in (Status.COMPLETED, Status.TRUNCATED) and len(s.weight_versions) == len(turns)
