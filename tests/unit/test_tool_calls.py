import json

import pytest

from slime.utils.tool_calls import ToolCall, parse_tool_calls


def test_plain_text_is_returned_unchanged():
    assert parse_tool_calls("just an answer") == ("just an answer", [])


def test_one_call_with_surrounding_text():
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "fox"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert calls == [ToolCall(name="search", arguments='{"query": "fox"}')]


def test_several_calls_keep_their_order_and_content_none_when_empty():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"y": [1, 2], "z": "é"}}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[1].arguments) == {"y": [1, 2], "z": "é"}


def test_unclosed_final_block_and_string_arguments():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}')
    assert content is None
    assert calls == [ToolCall(name="f", arguments='{"k": 2}')]


def test_missing_arguments_mean_an_empty_object():
    _, calls = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert calls == [ToolCall(name="now", arguments="{}")]


@pytest.mark.reliability("a <tool_call> block that is not a JSON call", "left in the message content, no tool call")
@pytest.mark.parametrize(
    "body",
    ['{"name": "f", "arguments": {', '["f"]', '{"arguments": {}}', '{"name": "f", "arguments": [1]}', "not json"],
)
def test_malformed_blocks_stay_text(body):
    text = f"before <tool_call>{body}</tool_call> after"
    assert parse_tool_calls(text) == (text, [])


def test_malformed_block_next_to_a_valid_one():
    text = '<tool_call>oops</tool_call> <tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "<tool_call>oops</tool_call>"
    assert [c.name for c in calls] == ["g"]
