import json
import re

import pytest

from slime.utils import openai_protocol as oai
from slime.utils.tool_calls import ToolCall

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
    ],
)
def test_sampling_bounds_are_refused_naming_the_field(fields, param):
    with pytest.raises(oai.OpenAIError) as caught:
        oai.sampling_fields(fields)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, "invalid_value")
    assert f"'{param}'" in error.message


def test_max_tokens_limit_is_inclusive():
    assert oai.sampling_fields({"max_tokens": 64}, max_tokens_limit=64) == {"max_new_tokens": 64}
    with pytest.raises(oai.OpenAIError, match=r"in \[1, 64\], got 65"):
        oai.sampling_fields({"max_tokens": 65}, max_tokens_limit=64)


def test_sampling_fields_map_to_sglang_names_and_leave_out_what_is_absent():
    assert oai.sampling_fields({}) == {}
    body = {"temperature": 2, "top_p": 1, "max_tokens": 7, "max_completion_tokens": 3, "stop": "\n\n"}
    params = oai.sampling_fields(body)
    assert params == {"temperature": 2.0, "top_p": 1.0, "max_new_tokens": 3, "stop": ["\n\n"]}
    assert isinstance(params["temperature"], float)
    assert oai.sampling_fields({"max_tokens": 7, "stop": ["a", "b", "c", "d"]}) == {
        "max_new_tokens": 7,
        "stop": ["a", "b", "c", "d"],
    }


def test_choices_and_seed_bounds():
    assert oai.choice_fields({}) == (1, None)
    # The largest seed: with 128 choices, choice 127 samples with seed + 127 = 2**63 - 2, still a 64-bit seed.
    assert oai.choice_fields({"n": 128, "seed": 9223372036854775679}) == (128, 9223372036854775679)
    for fields, param in [({"n": 0}, "n"), ({"n": 129}, "n"), ({"seed": -1}, "seed"), ({"seed": 2**63 - 128}, "seed")]:
        with pytest.raises(oai.OpenAIError) as caught:
            oai.choice_fields(fields)
        assert caught.value.param == param


def test_stream_fields():
    assert oai.stream_fields({}) == (False, False)
    assert oai.stream_fields({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    for fields, param in [({"stream": "yes"}, "stream"), ({"stream": True, "stream_options": [1]}, "stream_options")]:
        with pytest.raises(oai.OpenAIError) as caught:
            oai.stream_fields(fields)
        assert caught.value.param == param


def test_messages_field_names_the_bad_message():
    assert oai.messages_field({"messages": MESSAGES}) is MESSAGES
    for body, param in [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [*MESSAGES, {"role": "robot", "content": "x"}]}, "messages[1]"),
        ({"messages": ["hi"]}, "messages[0]"),
    ]:
        with pytest.raises(oai.OpenAIError) as caught:
            oai.messages_field(body)
        assert caught.value.param == param


def test_tools_field():
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    assert oai.tools_field({}) is None
    assert oai.tools_field({"tools": []}) is None
    assert oai.tools_field({"tools": [tool], "tool_choice": "auto"}) == [tool]
    for body, param in [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": {"name": "add"}}, "tools"),
        ({"tools": [tool], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ]:
        with pytest.raises(oai.OpenAIError) as caught:
            oai.tools_field(body)
        assert caught.value.param == param


def test_error_envelope_shape():
    assert oai.error_envelope("bad", 400, "top_p", "invalid_value") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": "invalid_value"}
    }
    assert oai.error_envelope("no such session", 404) == {
        "error": {"message": "no such session", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert oai.error_envelope("aborted", 503, code="aborted")["error"]["type"] == "server_error"


def test_sse_framing():
    assert oai.sse_event({"a": 1, "b": "x"}) == b'data: {"a": 1, "b": "x"}\n\n'
    assert oai.SSE_DONE == b"data: [DONE]\n\n"
    assert oai.SSE_HEADERS["Content-Type"] == "text/event-stream"


def test_tool_calls_get_ids_and_json_arguments():
    calls = [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("now", "{}")]
    built = oai.build_tool_calls(calls, id_prefix="call_abc_3")
    assert built == [
        {"id": "call_abc_3_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        {"id": "call_abc_3_1", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    random_ids = [call["id"] for call in oai.build_tool_calls(calls)]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in random_ids) and len(set(random_ids)) == 2
    assert oai.tool_call_deltas(built)[1] == {"index": 1, **built[1]}


def test_assistant_message_parses_calls_only_with_tools():
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert oai.assistant_message(text, None) == {"role": "assistant", "content": text}
    message = oai.assistant_message(text, [{"type": "function"}], id_prefix="call_x")
    assert message["content"] == "Let me add."
    [call] = message["tool_calls"]
    assert call["id"] == "call_x_0" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 1}
    assert oai.finish_reason(message, "stop") == "tool_calls"
    assert oai.finish_reason(oai.assistant_message("plain", [{"type": "function"}]), "length") == "length"


def test_usage_and_model_list():
    assert oai.usage(5, 3) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert oai.model_list("m", max_model_len=512) == {
        "object": "list",
        "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "slime", "max_model_len": 512}],
    }
