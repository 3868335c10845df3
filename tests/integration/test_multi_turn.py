"""Multi-turn samples: the loss masks of chat templates (`slime.utils.mask_utils`) and the token-in/token-out helpers
of `slime.agent.multi_turn`, driven against a real CPU engine process."""

import asyncio
import json

import pytest
import torch
from support.chat_templates import CONVERSATION, template_tokenizers
from support.engines import cpu_engine_process, engine_prompt_log_probs
from support.tiny_model import build_tokenizer
from transformers import AutoTokenizer

from slime.agent.multi_turn import (
    append_observation,
    context_limit,
    extract_tag,
    first_tool_call,
    model_turn,
    start_episode,
)
from slime.utils.arguments import parse_args
from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.types import Sample, Status

# ---- loss masks ------------------------------------------------------------------------------------------------
# Behaves like Qwen3's template: the reasoning of an assistant turn (`reasoning_content`, or a `<think>` block at
# the start of its content) is shown only for turns after the last user query, and a `<think>` block is always
# written for the last turn; tool results are grouped into one user turn; `enable_thinking=False` adds an empty
# `<think>` block to the generation prompt.
QWEN3_TEMPLATE = """
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not (message.content.startswith('<tool_response>')
            and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' }}
            {{- content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# Behaves like Qwen3.5's template as upstream slime's `qwen3_5` mask type describes it: thinking is on by default, so
# the generation prompt opens the <think> block ("<think>\n"; with `enable_thinking=False` an empty block); turns
# after the last user query show their reasoning (an empty block when they have none), earlier turns only their
# answer; tool calls come from `tool_calls` as <function=...> blocks with one <parameter=...> per argument.
QWEN35_TEMPLATE = """
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, seen_query=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.seen_query and message.role == "user" %}
        {%- set ns.seen_query = true %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content or '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content.strip('\n') }}
        {%- for call in message.tool_calls or [] %}
            {%- if content.strip('\n') or not loop.first %}{{- '\n\n' }}{%- endif %}
            {{- '<tool_call>\n<function=' + call.function.name + '>\n' }}
            {%- for name, value in call.function.arguments.items() %}
                {{- '<parameter=' + name + '>\n' + value | string + '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
    {%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""

ASSISTANT = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def tokenizers():
    qwen3 = build_tokenizer()
    qwen3.add_tokens(["<think>", "</think>", "<tool_response>", "</tool_response>"])  # plain added tokens, as in Qwen3
    qwen3.chat_template = QWEN3_TEMPLATE
    qwen35 = build_tokenizer()
    qwen35.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    qwen35.chat_template = QWEN35_TEMPLATE
    return {**template_tokenizers(), "qwen3": qwen3, "qwen3.5": qwen35}


def expected(tokenizer, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Token ids and mask of hand-written (text, trainable) pieces, each tokenized on its own."""
    ids, mask = [], []
    for text, trainable in pieces:
        piece_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece_ids
        mask += [trainable] * len(piece_ids)
    return ids, mask


def check_mask(tokenizer, messages, pieces, mask_type="qwen3", **template_kwargs):
    # The pieces, written from the template's layout, are the template's rendering of the whole conversation.
    assert "".join(text for text, _ in pieces) == tokenizer.apply_chat_template(
        messages, tokenize=False, **template_kwargs
    )
    generator = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=mask_type)
    assert generator.get_loss_mask(messages, chat_template_kwargs=template_kwargs) == expected(tokenizer, pieces)


def chatml_pieces(system: str) -> list[tuple[str, int]]:
    a1, a2, a3 = ASSISTANT
    return [
        (f"{system}<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n", 0),
        (f"{a1}<|im_end|>\n", 1),
        ("<|im_start|>TOOL<|im_end|>\n<|im_start|>assistant\n", 0),
        (f"{a2}<|im_end|>\n", 1),
        ("<|im_start|>user\nand 1 + 2?<|im_end|>\n<|im_start|>assistant\n", 0),
        (f"{a3}<|im_end|>\n", 1),
    ]


def test_chatml_masks_every_assistant_turn(tokenizers):
    system = "<|im_start|>system\nthink step by step, then answer.<|im_end|>\n"
    tiny = [(t.replace("TOOL", "tool\n0123456789"), m) for t, m in chatml_pieces(system)]
    check_mask(tokenizers["tiny"], CONVERSATION, tiny)
    tool_turn = "user\n<tool_response>\n0123456789\n</tool_response>"
    qwen25 = [(t.replace("TOOL", tool_turn), m) for t, m in chatml_pieces(system)]
    check_mask(tokenizers["qwen2.5"], CONVERSATION, qwen25)
    # Without a system message Qwen2.5's template adds its own, which is context.
    default = "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    no_system = [(t.replace(system, default), m) for t, m in qwen25]
    check_mask(tokenizers["qwen2.5"], CONVERSATION[1:], no_system)


def test_llama3_masks_every_assistant_turn(tokenizers):
    a1, a2, a3 = ASSISTANT

    def header(role):
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    pieces = [
        (f"<|begin_of_text|>{header('system')}think step by step, then answer.<|eot_id|>", 0),
        (f"{header('user')}What is 12 + 34?<|eot_id|>{header('assistant')}", 0),
        (f"{a1}<|eot_id|>", 1),
        (f"{header('tool')}0123456789<|eot_id|>{header('assistant')}", 0),
        (f"{a2}<|eot_id|>", 1),
        (f"{header('user')}and 1 + 2?<|eot_id|>{header('assistant')}", 0),
        (f"{a3}<|eot_id|>", 1),
    ]
    merged = [("".join(t for t, _ in pieces[:2]), 0), *pieces[2:]]
    check_mask(tokenizers["llama3"], CONVERSATION, merged)


# A tool loop after one query, reasoning in the first turn's content, a second query, and reasoning_content.
QWEN3_CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "What is 12 + 34?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n<tool_call>12+34</tool_call>"},
    {"role": "tool", "content": "46"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "The answer is 46."},
    {"role": "user", "content": "and 1 + 2?"},
    {"role": "assistant", "content": "3", "reasoning_content": "small"},
]
SYSTEM_USER = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n"
TOOLS = "<|im_start|>user\n<tool_response>\n46\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
QUERY2 = "<|im_start|>user\nand 1 + 2?<|im_end|>\n<|im_start|>assistant\n"


def test_qwen3_masks_each_turn_as_it_appears_in_the_whole_conversation(tokenizers):
    qwen3 = tokenizers["qwen3"]
    # Whole conversation: turns before the last query lose their reasoning, the last keeps its <think> block.
    check_mask(
        qwen3,
        QWEN3_CONVERSATION,
        [
            (SYSTEM_USER, 0),
            ("<tool_call>12+34</tool_call><|im_end|>\n", 1),
            (TOOLS + "<|im_start|>assistant\n", 0),
            ("The answer is 46.<|im_end|>\n", 1),
            (QUERY2, 0),
            ("<think>\nsmall\n</think>\n\n3<|im_end|>\n", 1),
        ],
    )
    # Up to the tool loop's answer: the first turn keeps its reasoning (it follows the last query), the answer
    # gets the empty <think> block of a last turn.
    check_mask(
        qwen3,
        QWEN3_CONVERSATION[:6],
        [
            (SYSTEM_USER, 0),
            ("<think>\nadd them\n</think>\n\n<tool_call>12+34</tool_call><|im_end|>\n", 1),
            (TOOLS + "<|im_start|>assistant\n", 0),
            ("<think>\n\n</think>\n\nThe answer is 46.<|im_end|>\n", 1),
        ],
    )


def test_qwen3_without_thinking_masks_earlier_turns_after_their_shorter_header(tokenizers):
    # enable_thinking=False: the generation prompt ends in an empty <think> block that only the last turn keeps.
    messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in QWEN3_CONVERSATION]
    messages[2]["content"] = "<tool_call>12+34</tool_call>"
    empty_think = "<think>\n\n</think>\n\n"
    check_mask(
        tokenizers["qwen3"],
        messages,
        [
            (SYSTEM_USER, 0),
            ("<tool_call>12+34</tool_call><|im_end|>\n", 1),
            (TOOLS + "<|im_start|>assistant\n", 0),
            ("The answer is 46.<|im_end|>\n", 1),
            (QUERY2 + empty_think, 0),
            ("3<|im_end|>\n", 1),
        ],
        enable_thinking=False,
    )


# Reasoning in the first turn, a tool call with its arguments, a tool result, a second query, a last turn with
# reasoning_content: the layout upstream's qwen3_5 mask type was written for.
QWEN35_CONVERSATION = [
    *QWEN3_CONVERSATION[:2],
    {
        "role": "assistant",
        "content": "<think>\nadd them\n</think>\n\nLet me check.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}],
    },
    {"role": "tool", "content": "46"},
    *QWEN3_CONVERSATION[5:],
]
ADD_CALL = "<tool_call>\n<function=add>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\n34\n</parameter>\n</function>\n</tool_call>"
TOOL_46 = "<|im_start|>user\n<tool_response>\n46\n</tool_response><|im_end|>\n"


def test_qwen3_5_masks_what_the_model_wrote_after_its_opened_think_block(tokenizers):
    qwen35 = tokenizers["qwen3.5"]
    assert qwen35.apply_chat_template(QWEN35_CONVERSATION[:2], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n"
    )
    # Whole conversation: the turns before the second query show only their answer (the <think> block the prompt
    # opened is gone with their reasoning); the last turn was written after "<think>\n".
    # The turns before the second query, as the whole conversation shows them with thinking on or off.
    history = [
        (SYSTEM_USER, 0),
        (f"Let me check.\n\n{ADD_CALL}<|im_end|>\n", 1),
        (TOOL_46 + "<|im_start|>assistant\n", 0),
        ("The answer is 46.<|im_end|>\n", 1),
    ]
    last_turn = [(QUERY2 + "<think>\n", 0), ("small\n</think>\n\n3<|im_end|>\n", 1)]
    check_mask(qwen35, QWEN35_CONVERSATION, history + last_turn, mask_type="qwen3_5")
    # Up to the tool loop's answer: both turns follow the last query, so each keeps its block and what the model
    # wrote after "<think>\n" (an empty block for the answer: the model closed it at once).
    check_mask(
        qwen35,
        QWEN35_CONVERSATION[:5],
        [
            (SYSTEM_USER + "<think>\n", 0),
            (f"add them\n</think>\n\nLet me check.\n\n{ADD_CALL}<|im_end|>\n", 1),
            (TOOL_46 + "<|im_start|>assistant\n<think>\n", 0),
            ("\n</think>\n\nThe answer is 46.<|im_end|>\n", 1),
        ],
        mask_type="qwen3_5",
    )
    # Thinking off: the prompt closes an empty block, which earlier turns drop.
    messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in QWEN35_CONVERSATION]
    messages[2]["content"] = "Let me check."
    last_turn = [(QUERY2 + "<think>\n\n</think>\n\n", 0), ("3<|im_end|>\n", 1)]
    check_mask(qwen35, messages, history + last_turn, mask_type="qwen3_5", enable_thinking=False)


@pytest.mark.reliability(
    "a chat template that rewrites earlier assistant turns, or the history, or a turn with reasoning under "
    "Qwen3's enable_thinking=False",
    "ValueError naming the turn and why it cannot be located, not a wrong mask",
)
def test_templates_whose_turns_cannot_be_located_are_refused(tokenizers):
    tokenizer = build_tokenizer()
    generator = MultiTurnLossMaskGenerator(tokenizer)
    # Earlier answers are replaced by a placeholder: nothing of what the model wrote is left to mask.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "<|im_start|>assistant\n[an earlier answer]<|im_end|>\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert generator.get_loss_mask(CONVERSATION[:3])[1].count(1) > 0  # one turn is fine
    with pytest.raises(ValueError, match="assistant turn at message 2: .* cannot be located"):
        generator.get_loss_mask(CONVERSATION)
    # The system prompt counts the messages, so every turn's history renders differently in the whole conversation.
    tokenizer.chat_template = (
        "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="assistant turn at message 2: the chat template's generation prompt is not"):
        generator.get_loss_mask(CONVERSATION)
    # Reasoning the model cannot have written with thinking off.
    qwen3 = MultiTurnLossMaskGenerator(tokenizers["qwen3"], tokenizer_type="qwen3")
    with pytest.raises(ValueError, match="assistant turn at message 2: the chat template's generation prompt"):
        qwen3.get_loss_mask(QWEN3_CONVERSATION, chat_template_kwargs={"enable_thinking": False})


# ---- action parsing --------------------------------------------------------------------------------------------
def test_extract_tag_and_tool_calls():
    text = "<search>first</search> then <search>\n capital of France \n</search> and <search>unclosed"
    assert extract_tag(text, "search") == "capital of France"
    assert extract_tag("no action here", "search") is None
    assert extract_tag("<answer>a</answer>", "search") is None
    call = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(1)"}}</tool_call>'
    assert first_tool_call("I will run it. " + call, ("code_interpreter",)) == (
        "code_interpreter",
        {"code": "print(1)"},
    )
    assert first_tool_call(call, ("search",)) is None
    assert first_tool_call("<tool_call>not json</tool_call>", ("code_interpreter",)) is None


# ---- the helpers against a real engine -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with cpu_engine_process(tiny_model_dir) as (client, url):
        yield client, url


def engine_args(model_dir, tmp_path, url, *flags):
    (tmp_path / "p.jsonl").write_text(json.dumps({"input": "hi"}) + "\n")
    args = parse_args([
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(tmp_path / "p.jsonl"),
        "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1", *flags,
    ])  # fmt: skip
    host, port = url.removeprefix("http://").split(":")
    args.sglang_router_ip, args.sglang_router_port = host, int(port)
    return args


PROMPT = [{"role": "user", "content": "What is 1 + 2?"}]


def prompt_text(tokenizer) -> str:
    return tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)


@pytest.mark.slow
def test_turns_and_observations_make_one_token_sequence(engine, tiny_model_dir, tmp_path):
    client, url = engine
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = engine_args(tiny_model_dir, tmp_path, url)
    prompt_ids = tokenizer(prompt_text(tokenizer), add_special_tokens=False)["input_ids"]
    greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    probe = client.generate({"input_ids": prompt_ids, "sampling_params": greedy})["output_ids"]
    # Stopping on the probe's third token ends the first turn there (or at an earlier end of sequence).
    first_turn_length = next(i for i, t in enumerate(probe) if t in (probe[2], tokenizer.eos_token_id)) + 1

    async def run() -> tuple:
        sample = Sample(index=0, prompt=PROMPT)
        episode = start_episode(args, sample)
        text1 = await model_turn(args, episode, {**greedy, "ignore_eos": False, "stop_token_ids": [probe[2]]})
        status1 = sample.status
        assert append_observation(episode, "<information>the quick brown fox</information>")
        text2 = await model_turn(args, episode, {**greedy, "max_new_tokens": 4})
        return sample, episode, text1, status1, text2

    sample, episode, text1, status1, text2 = asyncio.run(run())
    observation = tokenizer("<information>the quick brown fox</information>", add_special_tokens=False)["input_ids"]
    turn1 = probe[:first_turn_length]
    turn2 = sample.tokens[len(prompt_ids) + len(turn1) + len(observation) :]
    assert sample.tokens == prompt_ids + turn1 + observation + turn2 and len(turn2) == 4
    assert sample.loss_mask == [1] * len(turn1) + [0] * len(observation) + [1] * 4
    assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs)
    assert sample.response == text1 + "<information>the quick brown fox</information>" + text2
    assert (status1, sample.status, episode.turns, len(sample.weight_versions)) == (
        Status.COMPLETED,
        Status.TRUNCATED,  # the second turn ran out of tokens
        2,
        2,
    )
    # The model tokens carry the engine's log-probs of that very sequence; observation tokens carry 0.
    scored = engine_prompt_log_probs(client, sample.tokens)[len(prompt_ids) - 1 :]
    model = torch.tensor(sample.loss_mask, dtype=torch.bool)
    got = torch.tensor(sample.rollout_log_probs)
    torch.testing.assert_close(got[model], scored[model], atol=1e-4, rtol=0)
    assert got[~model].eq(0).all()


@pytest.mark.slow
def test_context_and_turn_budgets(engine, tiny_model_dir, tmp_path):
    _, url = engine
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_length = len(tokenizer(prompt_text(tokenizer), add_special_tokens=False)["input_ids"])
    free = engine_args(tiny_model_dir, tmp_path, url, "--max-turns", "3")
    assert context_limit(free) == 511  # the tiny model's max_position_embeddings, minus one
    # Every token is a stop token: each turn is one token and ends as COMPLETED, so only --max-turns stops the loop.
    one_token = {"temperature": 1.0, "max_new_tokens": 16, "stop_token_ids": list(range(len(tokenizer)))}

    async def until_done(args, observation: str, params: dict) -> tuple[Sample, int]:
        sample = Sample(index=0, prompt=PROMPT)
        episode = start_episode(args, sample)
        while not episode.done:
            await model_turn(args, episode, params)
            if episode.done or not append_observation(episode, observation):
                break
        return sample, episode.turns

    sample, turns = asyncio.run(until_done(free, "ok", one_token))
    assert turns == 3 and sample.status == Status.COMPLETED and sample.loss_mask.count(1) == 3

    # The context budget clips a turn: a 30-token turn in a context with room for 6 more tokens writes 6.
    tight = engine_args(tiny_model_dir, tmp_path, url, "--rollout-max-context-len", str(prompt_length + 6))
    long_turn = {"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True}
    sample, turns = asyncio.run(until_done(tight, "ok", long_turn))
    assert (turns, sample.status, len(sample.tokens), sample.loss_mask) == (
        1,
        Status.TRUNCATED,
        prompt_length + 6,
        [1] * 6,
    )

    # An observation that does not fit is cut to the room left and ends the sample.
    long_observation = " the quick brown fox" * 20
    sample, turns = asyncio.run(until_done(tight, long_observation, one_token))
    observation_ids = tokenizer(long_observation, add_special_tokens=False)["input_ids"]
    assert (turns, sample.status, len(sample.tokens)) == (1, Status.TRUNCATED, prompt_length + 6)
    assert sample.loss_mask == [1] + [0] * 5 and sample.tokens[-5:] == observation_ids[:5]
    assert sample.response.endswith(tokenizer.decode(observation_ids[:5]))


@pytest.mark.reliability("a prompt that leaves no room in --rollout-max-context-len", "ValueError naming the flags")
def test_prompt_that_fills_the_context_is_refused(tiny_model_dir, tmp_path):
    args = engine_args(tiny_model_dir, tmp_path, "http://127.0.0.1:1", "--rollout-max-context-len", "4")
    with pytest.raises(ValueError, match=r"leaves no room for a response .* --rollout-max-context-len"):
        start_episode(args, Sample(index=3, prompt=PROMPT))
