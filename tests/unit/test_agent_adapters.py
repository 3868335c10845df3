"""Upstream's agent names without processes or servers: `flatten_content`, the Anthropic wire translation, the
command / environment / settings each CLI harness builds, and the refusals (E2B without credentials, parsers the
proxy cannot apply, paths outside a LocalSandbox)."""

import asyncio
import json
import shlex

import pytest
import tomllib
from support.tiny_model import build_tokenizer

from slime.agent import anthropic_messages as wire
from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.adapters.common import flatten_content
from slime.agent.harness import CLAUDE_CODE, CODEX, ClaudeCodeHarness, HarnessContext
from slime.agent.sandbox import E2BSandbox, LocalSandbox
from slime.utils.openai_protocol import OpenAIError


def test_flatten_content_of_both_wire_formats():
    assert flatten_content(None) == "" and flatten_content("plain") == "plain" and flatten_content(7) == "7"
    openai_parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, "b"]
    assert flatten_content(openai_parts) == "a\n[image omitted]\nb"
    anthropic_blocks = [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "46"}]},
        {"type": "text", "text": ""},  # empty parts leave no blank line
        {"type": "output_text", "text": "done"},
    ]
    assert flatten_content(anthropic_blocks) == "46\ndone"


def test_anthropic_request_becomes_the_chat_turn_and_names_its_own_messages():
    body = {
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                {"type": "text", "text": "now explain"},
            ]},
        ],
    }  # fmt: skip
    messages, origins = wire.chat_messages(body)
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "now explain"},
    ]  # fmt: skip
    assert origins == ["system", "messages[0]", "messages[1]", "messages[2]", "messages[2]", "messages[2]"]
    error = wire.relocate(OpenAIError("messages[4] differs", "messages[4]"), origins)
    assert (error.message, error.param) == ("messages[2] differs", "messages[2]")

    with pytest.raises(OpenAIError, match=r"messages\[0\].content\[1\] is a 'document' block") as refused:
        wire.chat_messages(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, {"type": "document"}]}]}
        )
    assert refused.value.param == "messages[0].content[1]"


def test_anthropic_sampling_and_tool_fields_are_checked_by_their_names():
    tools = [{"name": "add", "description": "Add.", "input_schema": {"type": "object"}}]
    body = {"max_tokens": 9, "temperature": 0.5, "top_k": 4, "stop_sequences": ["\n\n"], "tools": tools,
            "tool_choice": {"type": "auto"}}  # fmt: skip
    assert wire.chat_body(body) == {
        "max_tokens": 9, "temperature": 0.5, "top_k": 4, "stop": ["\n\n"], "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}, "description": "Add."}}],
    }  # fmt: skip
    for bad, param in (
        ({}, "max_tokens"),
        ({"max_tokens": 5, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 5, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"max_tokens": 5, "stop_sequences": "x"}, "stop_sequences"),
        ({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ):
        with pytest.raises(OpenAIError) as refused:
            wire.chat_body(bad)
        assert refused.value.param == param


def test_stream_events_are_anthropics_sequence():
    message = {"role": "assistant", "content": "sum is",
               "tool_calls": [{"id": "c0", "function": {"name": "add", "arguments": '{"a": 1}'}}]}  # fmt: skip
    blocks = wire.content_blocks(message)
    assert blocks == [
        {"type": "text", "text": "sum is"},
        {"type": "tool_use", "id": "c0", "name": "add", "input": {"a": 1}},
    ]
    assert wire.stop_reason(message, "stop", None) == ("tool_use", None)
    assert wire.stop_reason({"content": "x"}, "stop", "###") == ("stop_sequence", "###")
    assert wire.stop_reason({"content": "x"}, "length", None) == ("max_tokens", None)
    response = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": blocks,
                "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 7}}  # fmt: skip
    events = []
    for raw in wire.stream_events(response):
        name, data = raw.decode().removesuffix("\n\n").split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert [name for name, data in events] == [data["type"] for _, data in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert "".join(d["delta"]["text"] for _, d in events[2:4]) == "sum is"
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "c0", "name": "add", "input": {}}
    assert json.loads(events[6][1]["delta"]["partial_json"]) == {"a": 1}
    assert events[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[8][1]["usage"] == {"output_tokens": 7}


CTX = HarnessContext(workdir="/work/task", session_id="sid-7", adapter_url="http://10.0.0.2:18001")


def test_claude_code_harness_points_claude_at_the_server():
    argv = shlex.split(shlex.join(CLAUDE_CODE.command(CTX, "fix the 'bug' in x.py")))
    assert argv[:3] == ["claude", "-p", "fix the 'bug' in x.py"] and "bypassPermissions" in argv
    env = CLAUDE_CODE.env(CTX)
    assert env["ANTHROPIC_BASE_URL"] == "http://10.0.0.2:18001" and env["ANTHROPIC_AUTH_TOKEN"] == "sid-7"
    assert env["ANTHROPIC_MODEL"] == "slime-actor" and env["HOME"] == "/work/task/.harness/home"
    files = CLAUDE_CODE.config_files(CTX)
    assert set(files) == {"/work/task/.harness/home/.claude.json", "/work/task/.harness/home/.claude/settings.json"}
    assert all(json.loads(text)["bypassPermissionsModeAccepted"] for text in files.values())
    custom = ClaudeCodeHarness(extra_args=("--max-turns", "5"), extra_env={"ANTHROPIC_MODEL": "qwen"})
    assert (custom.extra_args, custom.extra_env) == (("--max-turns", "5"), {"ANTHROPIC_MODEL": "qwen"})


def test_codex_harness_points_codex_at_the_server():
    assert CODEX.command(CTX, "go")[:2] == ["codex", "exec"] and CODEX.command(CTX, "go")[-1] == "go"
    env = CODEX.env(CTX)
    assert env["OPENAI_API_KEY"] == "sid-7" and env["OPENAI_BASE_URL"] == "http://10.0.0.2:18001/v1"
    [(path, text)] = CODEX.config_files(CTX).items()
    assert path == "/work/task/.harness/home/.codex/config.toml"
    config = tomllib.loads(text)
    assert config["model_provider"] == "slime" and config["model"] == "slime-actor"
    provider = config["model_providers"]["slime"]
    assert provider == {"name": "slime", "base_url": "http://10.0.0.2:18001/v1", "env_key": "OPENAI_API_KEY",
                        "wire_api": "chat"}  # fmt: skip


@pytest.mark.reliability("E2BSandbox used without E2B credentials", "RuntimeError naming E2B_API_KEY and LocalSandbox")
def test_e2b_sandbox_without_credentials_is_refused(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="set the E2B_API_KEY environment variable.*LocalSandbox"):
        asyncio.run(E2BSandbox("python-3.11").__aenter__())


def test_local_sandbox_paths_stay_inside_its_workdir(tmp_path):
    sb = LocalSandbox()
    with pytest.raises(ValueError, match="not open"):
        sb.path("x")
    sb.workdir = str(tmp_path)
    assert sb.path("a/b.py") == str(tmp_path / "a" / "b.py") and sb.path(str(tmp_path / "c")) == str(tmp_path / "c")
    for escape in ("../x", "/etc/passwd", "a/../../x"):
        with pytest.raises(ValueError, match="outside this sandbox's working directory"):
            sb.path(escape)


@pytest.mark.reliability(
    "an adapter asked for a tool or reasoning parser the proxy cannot apply",
    "ValueError naming the parser and the ones it can",
)
def test_adapters_refuse_parsers_they_cannot_apply():
    tokenizer = build_tokenizer()
    with pytest.raises(ValueError, match="tool_parser='llama3'.*hermes, qwen, qwen25"):
        OpenAIAdapter(tokenizer=tokenizer, sglang_url="http://127.0.0.1:1", tool_parser="llama3")
    with pytest.raises(ValueError, match="reasoning_parser='qwen3'"):
        AnthropicAdapter(tokenizer=tokenizer, sglang_url="http://127.0.0.1:1", reasoning_parser="qwen3")
    # Each serves its own wire format.
    routes = {
        cls.__name__: {
            r.resource.canonical for r in cls(tokenizer=tokenizer, sglang_url="http://e/").app.router.routes()
        }
        for cls in (OpenAIAdapter, AnthropicAdapter)
    }
    assert "/v1/chat/completions" in routes["OpenAIAdapter"] and "/v1/messages" not in routes["OpenAIAdapter"]
    assert "/v1/messages" in routes["AnthropicAdapter"] and "/v1/chat/completions" not in routes["AnthropicAdapter"]
