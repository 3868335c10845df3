"""Anthropic's Messages wire format (`POST /v1/messages`) over the trajectory proxy's OpenAI-shaped turns.

A request is translated into the chat messages, tools and sampling fields the proxy's one turn pipeline takes
(`TrajectoryProxy._turn`), so both wire formats record a session the same way; the finished turn is rendered back as
a Messages response or as its server-sent events.

Translation:
- `system` (a string or text blocks) becomes the first message, role "system".
- A user message's `tool_result` blocks become "tool" messages (in order, `tool_call_id` = `tool_use_id`), its text
  blocks a "user" message; an assistant message's text blocks its content and its `tool_use` blocks its
  `tool_calls` (arguments = `input`), so a reply sent back as returned extends the session's history.
- `tools` [{name, description, input_schema}] become function tools; `tool_choice` auto / none only (nothing
  can force a call); `max_tokens` (required), `temperature` in [0, 1], `top_p`, `top_k`, `stop_sequences`.
- `image` blocks (a base64 `source`) in user messages and tool results become `image_url` parts with a `data:` URL:
  a vision-language model takes them, a text-only one refuses them (the proxy's turn pipeline decides).
Documents and thinking blocks are refused: the proxy never writes thinking blocks.

Errors have Anthropic's shape {"type": "error", "error": {"type", "message"}} plus the proxy's reason in `code`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from slime.utils import openai_protocol as oai

SSE_HEADERS = oai.SSE_HEADERS
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
# Anthropic's error types by HTTP status; other 5xx are api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _invalid(message: str, param: str) -> oai.OpenAIError:
    return oai.OpenAIError(message, param, code="invalid_value")


def _text_blocks(content: Any, where: str) -> str:
    """The text of a `content` that may hold only text: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return "".join(b["text"] for b in content)
    raise _invalid(f"{where} must be a string or a list of {{'type': 'text', 'text': ...}} blocks", where)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _invalid(f"{where} must be a string or a list of content blocks", where)
    return content


def chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The request's `system` and `messages` as OpenAI-style chat messages (see the module docstring), and where each
    came from in the request ("system", "messages[3]"), to name it in errors (`relocate`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    origins = ["system"] * len(out)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _invalid(f"{where} must be an object with 'role' user or assistant", where)
        blocks = _blocks(message.get("content"), f"{where}.content")
        if message["role"] == "assistant":
            out.append(_assistant_message(blocks, where))
        else:
            out += _user_messages(blocks, where)
        origins += [where] * (len(out) - len(origins))
    return out, origins


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An `image` block as an OpenAI `image_url` part (a base64 source as a `data:` URL)."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    elif isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]  # refused where images are read: runs are offline
    else:
        raise _invalid(
            f"{where}.source must be {{'type': 'base64', 'media_type': 'image/png', 'data': ...}}", f"{where}.source"
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text and image parts as chat content: the joined text when there is no image."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _result_content(result: Any, where: str) -> str | list[dict[str, Any]]:
    """A tool result's content (a string, or text and image blocks) as chat content."""
    if not isinstance(result, list):
        return _text_blocks(result, where) if result else ""
    parts = []
    for k, block in enumerate(result):
        if isinstance(block, dict) and block.get("type") == "image":
            parts.append(_image_part(block, f"{where}[{k}]"))
        else:
            parts.append({"type": "text", "text": _text_blocks([block], where)})
    return _content(parts)


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user message's blocks as chat messages: each tool result a "tool" message, each run of text and images a
    "user" one."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, f"{where}.content[{j}]"))
        elif kind == "tool_result":
            if parts:  # text before a tool result is its own user turn
                out.append({"role": "user", "content": _content(parts)})
                parts = []
            content = _result_content(block.get("content", ""), f"{where}.content[{j}].content")
            if block.get("is_error"):
                content = (
                    f"Error: {content}" if isinstance(content, str) else [{"type": "text", "text": "Error: "}, *content]
                )
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": content})
        else:
            raise _refused_block(kind, f"{where}.content[{j}]")
    if parts:
        out.append({"role": "user", "content": _content(parts)})
    return out


def relocate(error: oai.OpenAIError, origins: list[str]) -> oai.OpenAIError:
    """`error` with the chat messages it names (`messages[i]`) renamed to where they came from in the request."""

    def where(match: re.Match) -> str:
        i = int(match.group(1))
        return origins[i] if i < len(origins) else match.group(0)

    error.message = re.sub(r"messages\[(\d+)\]", where, error.message)
    if error.param:
        error.param = re.sub(r"messages\[(\d+)\]", where, error.param)
    return error


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("name"), str):
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {"id": block.get("id"), "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        else:
            raise _refused_block(kind, f"{where}.content[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _refused_block(kind: Any, where: str) -> oai.OpenAIError:
    return _invalid(
        f"{where} is a {kind!r} block; the trajectory proxy takes text, image (user turns and tool results), "
        "tool_use and tool_result blocks only (it writes no thinking blocks)",
        where,
    )


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """`tools` as OpenAI function tools; None when there are none."""
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise _invalid("'tools' must be a list of {'name', 'description', 'input_schema'}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or "input_schema" not in tool:
            raise _invalid(
                f"tools[{i}] must be a custom tool {{'name', 'description', 'input_schema'}}; server tools "
                "(web search, bash, text editor, ...) are not run by the trajectory proxy",
                f"tools[{i}]",
            )
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-shaped fields the proxy's turn reads (tools, tool_choice, sampling), checked as Anthropic names them."""
    max_tokens = body.get("max_tokens")
    if not oai.is_integer(max_tokens) or max_tokens < 1:
        raise _invalid(f"'max_tokens' is required and must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    out: dict[str, Any] = {"max_tokens": max_tokens, "tools": chat_tools(body)}
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "none"):
            raise _invalid(
                "'tool_choice' must be {'type': 'auto'} or {'type': 'none'}: a tool call cannot be forced here",
                "tool_choice",
            )
        out["tool_choice"] = kind
    for name, high in (("temperature", 1), ("top_p", 1)):
        if body.get(name) is not None:
            out[name] = oai.number_field(body, name, 0, high)
    top_k = oai.integer_field(body, "top_k", 1, None)
    if top_k is not None:
        out["top_k"] = top_k
    stops = body.get("stop_sequences")
    if stops:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _invalid("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
        out["stop"] = stops
    return out


# ---- responses ------------------------------------------------------------------------------
def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant chat message (content and tool_calls) as Messages content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}
        )
    return blocks or [{"type": "text", "text": ""}]


def stop_reason(message: dict[str, Any], finish_reason: str, matched_stop: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a turn."""
    if message.get("tool_calls"):
        return "tool_use", None
    if matched_stop is not None:
        return "stop_sequence", matched_stop
    return STOP_REASONS[finish_reason], None


def stream_events(response: dict[str, Any]) -> list[bytes]:
    """A finished Messages response as Anthropic's event sequence: message_start, each content block as
    content_block_start / deltas / content_block_stop, message_delta (stop reason, output tokens), message_stop.
    Text is sent a word at a time; a tool call's input as one input_json_delta."""
    start = {**response, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**response["usage"], "output_tokens": 0}
    events = [_event("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(response["content"]):
        if block["type"] == "text":
            opening = {"type": "text", "text": ""}
            # Each piece is a word and the spaces after it: together they are the text exactly.
            deltas = [{"type": "text_delta", "text": piece} for piece in re.findall(r"\S*\s*", block["text"]) if piece]
        else:
            opening = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
        events.append(
            _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening})
        )
        for delta in deltas:
            events.append(
                _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            )
        events.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta = {"stop_reason": response["stop_reason"], "stop_sequence": response["stop_sequence"]}
    events.append(
        _event(
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": {"output_tokens": response["usage"]["output_tokens"]}},
        )
    )
    events.append(_event("message_stop", {"type": "message_stop"}))
    return events


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def error_envelope(message: str, status: int, code: str | None = None) -> dict[str, Any]:
    """Anthropic's error body; `code` is the proxy's reason (e.g. "history_mismatch")."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message, "code": code}}
