"""The trajectory proxy's Anthropic Messages route against a real CPU engine process, driven by the real `anthropic`
client, and checked token for token against what the OpenAI route records for the same conversation.

The engine serves a copy of the tiny model taught one tool conversation by heart (support.tiny_model), so at
temperature 0 it really answers with a `<tool_call>` block, then with the answer after the tool's result.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import TYPE_CHECKING

import openai
import pytest
from support.engines import engine_server
from support.tiny_model import teach_tiny_model
from transformers import AutoTokenizer

from slime.agent.adapters import AnthropicAdapter
from slime.agent.aiohttp_threaded import FilteredAccessLogger, run_app_in_thread
from slime.agent.trajectory_proxy import TrajectoryProxy, session_to_sample
from slime.utils.types import Sample

if TYPE_CHECKING:  # imported where used: `anthropic` costs every worker that collects this file ~1.2 s
    import anthropic

API_KEY = "engine-key"
SYSTEM = "use the tools"
QUESTION = "What is 12 + 34?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call>'
ANSWER = "The answer is 46."
RESULT = "46"
TOOL_TURN = f"<|im_start|>tool\n{RESULT}<|im_end|>\n<|im_start|>assistant\n"
SAMPLING = {"temperature": 0.0, "max_new_tokens": 96}
ADD_TOOL = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tokenizer, tmp_path_factory):
    """One CPU engine (API key required) serving the tiny model taught CALL, then ANSWER after the tool result."""
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    pieces = [(prompt, 0), (CALL + "<|im_end|>", 1), ("\n" + TOOL_TURN, 0), (ANSWER + "<|im_end|>", 1)]
    model = teach_tiny_model(tiny_model_dir, tmp_path_factory.mktemp("taught") / "model", pieces)
    with engine_server(model, "--api-key", API_KEY) as (_, url):
        yield url


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def assert_is_the_tool_conversation(sample: Sample, tokenizer) -> None:
    """The sample's response is the call, the tool's turn and the answer, with the tool's turn masked out."""
    call, tool_turn, answer = (
        ids(tokenizer, CALL + "<|im_end|>"),
        ids(tokenizer, "\n" + TOOL_TURN),
        ids(tokenizer, ANSWER + "<|im_end|>"),
    )
    assert sample.tokens[sample.prompt_length :] == call + tool_turn + answer
    assert sample.loss_mask == [1] * len(call) + [0] * len(tool_turn) + [1] * len(answer)


class Harness:
    """A running proxy in front of the engine, with the sessions and clients a test opens (closed at the end)."""

    def __init__(self, proxy: TrajectoryProxy, engine_url: str):
        self.proxy, self.engine_url, self.clients = proxy, engine_url, []

    def session(self, **kwargs):
        return self.proxy.open_session([self.engine_url], sampling_params=SAMPLING, **kwargs)

    def client(self, cls=None, **kwargs):
        import anthropic

        self.clients.append((cls or anthropic.AsyncAnthropic)(**kwargs, max_retries=0))
        return self.clients[-1]

    def anthropic(self, session) -> anthropic.AsyncAnthropic:
        return self.client(base_url=self.proxy.anthropic_base_url(session.session_id), api_key="any")


async def with_proxy(engine_url: str, tokenizer, talk):
    """Start a proxy and return `await talk(Harness(proxy, engine_url))`."""
    proxy = TrajectoryProxy(tokenizer, api_key=API_KEY)
    await proxy.start()
    harness = Harness(proxy, engine_url)
    try:
        return await talk(harness)
    finally:
        for client in harness.clients:
            await client.close()
        await proxy.stop()


def test_plain_message_and_max_tokens(engine, tokenizer):
    async def talk(h):
        session, short = h.session(), h.session()
        reply = await h.anthropic(session).messages.create(
            model="tiny", max_tokens=96, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
        )
        cut = await h.anthropic(short).messages.create(
            model="tiny", max_tokens=3, messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
        )
        return session, reply, cut

    session, reply, cut = asyncio.run(with_proxy(engine, tokenizer, talk))
    [turn] = session.turns
    assert (
        turn.prompt_ids == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    # Without tools the call block is plain text; the model ends its turn itself.
    assert turn.text == CALL and turn.finish_reason == "stop"
    assert reply.type == "message" and reply.role == "assistant" and reply.model == "tiny"
    assert [(b.type, b.text) for b in reply.content] == [("text", CALL)]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(turn.prompt_ids), len(turn.output_ids))
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_streaming_follows_anthropics_event_sequence(engine, tokenizer):
    async def talk(h):
        plain, tools = h.session(), h.session()
        stream = await h.anthropic(plain).messages.create(
            model="tiny", max_tokens=96, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], stream=True
        )
        events = [event async for event in stream]
        async with h.anthropic(tools).messages.stream(
            model="tiny",
            max_tokens=96,
            system=SYSTEM,
            tools=[ADD_TOOL],
            messages=[{"role": "user", "content": QUESTION}],
        ) as tool_stream:
            tool_message = await tool_stream.get_final_message()
        return plain, events, tool_message

    plain, events, tool_message = asyncio.run(with_proxy(engine, tokenizer, talk))
    kinds = [event.type for event in events]
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    n = len(deltas)
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * n, "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    assert n > 1 and "".join(deltas) == CALL == plain.turns[0].text
    assert events[0].message.usage.input_tokens == len(plain.turns[0].prompt_ids)
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == len(plain.turns[0].output_ids)
    # A streamed tool call: the client assembles the input from its input_json_delta.
    [block] = tool_message.content
    assert (block.type, block.name, block.input) == ("tool_use", "add", {"a": 12, "b": 34})
    assert tool_message.stop_reason == "tool_use"


def anthropic_conversation(client: anthropic.AsyncAnthropic):
    """The tool round trip: the model calls add, gets RESULT back as a tool_result, answers."""

    async def run():
        messages = [{"role": "user", "content": QUESTION}]
        first = await client.messages.create(
            model="tiny", max_tokens=96, system=SYSTEM, tools=[ADD_TOOL], messages=messages
        )
        [call] = first.content
        messages += [
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]},
        ]
        second = await client.messages.create(
            model="tiny", max_tokens=96, system=SYSTEM, tools=[ADD_TOOL], messages=messages
        )
        return first, second, messages

    return run()


def test_tool_use_round_trip(engine, tokenizer):
    import anthropic

    async def talk(h):
        session = h.session()
        client = h.anthropic(session)
        first, second, messages = await anthropic_conversation(client)
        # The same history with the model's call edited is refused in Anthropic's error shape, and changes nothing.
        edited = json.loads(json.dumps(messages))
        edited[1]["content"][0]["input"] = {"a": 1, "b": 34}
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="tiny", max_tokens=8, tools=[ADD_TOOL], system=SYSTEM, messages=edited)
        with pytest.raises(anthropic.NotFoundError) as unknown:
            unknown_session = h.client(base_url=f"{h.proxy.url}/sessions/nope", api_key="x")
            await unknown_session.messages.create(
                model="tiny", max_tokens=8, messages=[{"role": "user", "content": QUESTION}]
            )
        return session, first, second, refused.value, unknown.value

    session, first, second, refused, unknown = asyncio.run(with_proxy(engine, tokenizer, talk))
    [call] = first.content
    assert (call.type, call.name, call.input) == ("tool_use", "add", {"a": 12, "b": 34})
    assert first.stop_reason == "tool_use"
    assert [(b.type, b.text) for b in second.content] == [("text", ANSWER)] and second.stop_reason == "end_turn"
    first_turn, second_turn = session.turns
    # The model sampled <|im_end|>, so the tool result's context starts with the newline after it.
    assert second_turn.context_ids == ids(tokenizer, "\n" + TOOL_TURN)
    assert second_turn.prompt_ids == first_turn.prompt_ids + first_turn.output_ids + second_turn.context_ids
    # Anthropic's error shape, naming the request's own message (messages[1], not the system-first chat index).
    assert refused.status_code == 400 and refused.body["type"] == "error"
    assert (
        refused.body["error"]["type"] == "invalid_request_error" and refused.body["error"]["code"] == "history_mismatch"
    )
    assert refused.body["error"]["message"].startswith("messages[1] does not extend session")
    assert unknown.status_code == 404 and unknown.body["error"]["code"] == "session_not_found"
    assert unknown.body["error"]["type"] == "not_found_error"


def test_trajectory_equals_the_openai_routes(engine, tokenizer):
    """The same conversation through the OpenAI route and through the Anthropic one (here on the /v1 route keyed by
    the session id, as the Claude Code harness calls it) records the same tokens, loss mask and log-probs."""

    async def talk(h):
        via_openai, via_anthropic = h.session(), h.session(session_id="sid-claude")
        client = h.client(openai.AsyncOpenAI, base_url=h.proxy.base_url(via_openai.session_id), api_key="any")
        tool = {"type": "function", "function": {"name": "add", "parameters": ADD_TOOL["input_schema"]}}
        chat = list(CHAT)
        first = await client.chat.completions.create(model="tiny", messages=chat, tools=[tool], max_tokens=96)
        [call] = first.choices[0].message.tool_calls
        chat += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": RESULT},
        ]
        await client.chat.completions.create(model="tiny", messages=chat, tools=[tool], max_tokens=96)
        await anthropic_conversation(h.client(base_url=h.proxy.url, api_key=via_anthropic.session_id))
        return h.proxy.close_session(via_openai.session_id), h.proxy.close_session(via_anthropic.session_id)

    via_openai, via_anthropic = asyncio.run(with_proxy(engine, tokenizer, talk))
    a = session_to_sample(via_openai, Sample(index=0, prompt=CHAT))
    b = session_to_sample(via_anthropic, Sample(index=0, prompt=CHAT))
    assert len(a.tokens) > a.prompt_length and a.response == b.response
    assert (b.tokens, b.loss_mask, b.response_length) == (a.tokens, a.loss_mask, a.response_length)
    assert b.rollout_log_probs == pytest.approx(a.rollout_log_probs, abs=1e-5)
    # Independently: the prompt, the call, the tool turn and the answer, trained on the model's turns only.
    expected = ids(tokenizer, tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    response = [
        ids(tokenizer, CALL + "<|im_end|>"),
        ids(tokenizer, "\n" + TOOL_TURN),
        ids(tokenizer, ANSWER + "<|im_end|>"),
    ]
    assert b.tokens == expected + response[0] + response[1] + response[2]
    assert b.loss_mask == [1] * len(response[0]) + [0] * len(response[1]) + [1] * len(response[2])


def test_anthropic_adapter_served_from_its_own_thread(engine, tokenizer):
    """Upstream's wiring: an AnthropicAdapter app in a thread of its own (run_app_in_thread), a session keyed by the
    API key, and finish_session called from the rollout's loop returning the reward-carrying sample."""
    import anthropic

    adapter = AnthropicAdapter(tokenizer=tokenizer, sglang_url=engine + "/", api_key=API_KEY, max_turns_per_sid=2)
    handle = run_app_in_thread(adapter.app, runner_kwargs={"access_log_class": FilteredAccessLogger})

    async def rollout():
        adapter.open_session("cagent-1", sampling_defaults=SAMPLING)
        with pytest.raises(ValueError, match="already open"):
            adapter.open_session("cagent-1")
        async with anthropic.AsyncAnthropic(base_url=handle.url, api_key="cagent-1", max_retries=0) as client:
            _, second, _ = await anthropic_conversation(client)
        sample = Sample(index=3, prompt=CHAT, metadata={"task": "add"})
        samples = await adapter.finish_session("cagent-1", base_sample=sample, reward=1.0, extra_metadata={"rc": 0})
        return second, samples, await adapter.finish_session("cagent-1", base_sample=sample)

    try:
        second, samples, again = asyncio.run(rollout())
    finally:
        handle.stop()
    assert second.content[0].text == ANSWER
    [sample] = samples
    assert sample.reward == 1.0 and sample.metadata == {"task": "add", "rc": 0} and sample.session_id == "cagent-1"
    assert_is_the_tool_conversation(sample, tokenizer)
    assert again == []  # finishing twice is safe
    assert not handle.thread.is_alive()


# A stand-in for the `claude` CLI: what Claude Code does on the wire in `-p` mode, with the real `anthropic` client
# configured only from the environment the harness gives it (base URL, bearer token, model, HOME).
STUB_CLAUDE = """
import json, os, sys
import anthropic

args = sys.argv[1:]
prompt = args[args.index("-p") + 1]
assert args[args.index("--permission-mode") + 1] == "bypassPermissions", args
settings = json.load(open(os.path.join(os.environ["HOME"], ".claude", "settings.json")))
assert settings["bypassPermissionsModeAccepted"], settings
client = anthropic.Anthropic(max_retries=0)
messages = [{"role": "user", "content": prompt}]
while True:
    reply = client.messages.create(
        model=os.environ["ANTHROPIC_MODEL"], max_tokens=96, system=SYSTEM, messages=messages, tools=[ADD_TOOL]
    )
    print(json.dumps({"type": "assistant", "stop_reason": reply.stop_reason}), flush=True)
    if reply.stop_reason != "tool_use":
        break
    [call] = [block for block in reply.content if block.type == "tool_use"]
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": str(sum(call.input.values()))}]},
    ]
print(json.dumps({"type": "result", "result": reply.content[0].text}), flush=True)
"""


def test_claude_code_harness_drives_its_cli_through_the_adapter(engine, tokenizer):
    """ClaudeCodeHarness.run in a LocalSandbox with network: it finds the CLI, writes its settings under the run's
    HOME, and the CLI, knowing only the environment the harness set, holds a tool-using conversation with the
    AnthropicAdapter under the session id; the session's sample is the conversation token for token."""
    import sys

    from slime.agent.harness import ClaudeCodeHarness
    from slime.agent.sandbox import LocalSandbox, SandboxLimits

    adapter = AnthropicAdapter(tokenizer=tokenizer, sglang_url=engine, api_key=API_KEY, max_turns_per_sid=4)
    handle = run_app_in_thread(adapter.app)
    harness = ClaudeCodeHarness()

    async def rollout():
        adapter.open_session("claude-1", sampling_defaults=SAMPLING)
        async with LocalSandbox(SandboxLimits(allow_network=True, memory_mb=4096)) as sb:
            constants = f"SYSTEM = {SYSTEM!r}\nADD_TOOL = {ADD_TOOL!r}\n"
            await sb.write_file("bin/claude", f"#!{sys.executable}\n{constants}{STUB_CLAUDE}")
            os.chmod(sb.path("bin/claude"), 0o755)
            harness.binary = sb.path("bin/claude")  # where this machine has "claude"; the real one is on the PATH
            code = await harness.run(
                sb, workdir=sb.workdir, session_id="claude-1", adapter_url=handle.url, time_budget_sec=120,
                prompt=QUESTION,
            )  # fmt: skip
            output = await sb.read_file(".harness/output.log")
        samples = await adapter.finish_session("claude-1", base_sample=Sample(index=0, prompt=CHAT), reward=1.0)
        return code, output, samples

    try:
        code, output, samples = asyncio.run(rollout())
    finally:
        handle.stop()
    assert code == 0, output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert [e.get("stop_reason") for e in events[:2]] == ["tool_use", "end_turn"]
    assert events[-1] == {"type": "result", "result": ANSWER}
    [sample] = samples
    assert_is_the_tool_conversation(sample, tokenizer)
