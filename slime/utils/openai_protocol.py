"""The OpenAI chat / completions wire format both slime servers speak: the CPU engine's /v1 routes and the
trajectory proxy.

One place for the request bounds and their validation, the error envelope, server-sent-event framing,
assistant messages with tool calls, and the usage block. Bounds follow OpenAI's API: temperature in [0, 2],
top_p in (0, 1], max_tokens >= 1, n in [1, 128], at most 4 stop strings, seed in [0, 2**63 - 129] (choice i of a
seeded request samples with `seed + i`, which must stay a 64-bit seed). A request that breaks one is refused
with an `OpenAIError` naming the field as the client spelled it.
"""

from __future__ import annotations

import json
import math
import uuid
import weakref
from typing import Any

from slime.utils.tool_calls import ToolCall, parse_tool_calls

MAX_TEMPERATURE = 2.0
MAX_CHOICES = 128
# Bodies above this are parsed on a worker thread; below it the thread hop costs more than the parse.
PARSE_OFF_LOOP_BYTES = 256 * 2**10
MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1 - MAX_CHOICES
ROLES = ("system", "developer", "user", "assistant", "tool")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"


class OpenAIError(ValueError):
    """A request answered with OpenAI's error envelope.

    Args:
        message: What was wrong and what to send instead.
        param: The request field at fault, e.g. "temperature" or "messages[2]".
        status: The HTTP status.
        code: The envelope's `code` (e.g. "invalid_value"); servers may put their own convention there.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def _invalid(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, param, code="invalid_value")


def error_envelope(message: str, status: int, param: str | None = None, code: str | int | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`; `type` is invalid_request_error for 4xx, else server_error."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ----- request fields ------------------------------------------------------------------------


def is_integer(value: Any) -> bool:
    """A JSON integer (Python's bool is an int, JSON's true is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def number_field(body: dict, name: str, low: float, high: float, default: float | None = None) -> float | None:
    """`body[name]` as a float checked to lie in [low, high]; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(f"'{name}' must be a number in [{low}, {high}], got {value!r}", name)
    if not low <= value <= high:
        raise _invalid(f"'{name}' must be in [{low}, {high}], got {value!r}", name)
    return float(value)


def integer_field(body: dict, name: str, low: int, high: int | None, default: int | None = None) -> int | None:
    """`body[name]` checked to be an integer in [low, high] (`high` None: no upper bound); `default` when absent."""
    value = body.get(name)
    if value is None:
        return default
    if not is_integer(value) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _invalid(f"'{name}' must be an integer {bounds}, got {value!r}", name)
    return value


def bool_field(body: dict, name: str) -> bool:
    """`body[name]` checked to be true or false; False when absent or null."""
    value = body.get(name) or False
    if not isinstance(value, bool):
        raise _invalid(f"'{name}' must be true or false, got {value!r}", name)
    return value


def sampling_fields(body: dict, max_tokens_limit: int | None = None) -> dict[str, Any]:
    """The OpenAI sampling fields a request sets, as SGLang `sampling_params` (fields left out are left out).

    `max_completion_tokens` wins over the older `max_tokens`; each is checked, and capped by `max_tokens_limit`
    when given. Returns a subset of {"temperature", "top_p", "max_new_tokens", "stop"}.
    """
    params: dict[str, Any] = {}
    if (temperature := number_field(body, "temperature", 0, MAX_TEMPERATURE)) is not None:
        params["temperature"] = temperature
    if (top_p := number_field(body, "top_p", 0, 1)) is not None:
        if top_p == 0:
            raise _invalid("'top_p' must be in (0, 1], got 0", "top_p")
        params["top_p"] = top_p
    max_tokens = integer_field(body, "max_tokens", 1, max_tokens_limit)
    max_completion_tokens = integer_field(body, "max_completion_tokens", 1, max_tokens_limit)
    if max_completion_tokens is not None or max_tokens is not None:
        params["max_new_tokens"] = max_completion_tokens if max_completion_tokens is not None else max_tokens
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        valid = isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
        if not valid or len(stops) > MAX_STOP_STRINGS:
            raise _invalid(
                f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS}, got {stop!r}", "stop"
            )
        params["stop"] = stops
    return params


def choice_fields(body: dict) -> tuple[int, int | None]:
    """(n, seed): how many choices (default 1) and the sampling seed (None when unseeded)."""
    return integer_field(body, "n", 1, MAX_CHOICES, 1), integer_field(body, "seed", 0, MAX_SEED)


def stream_fields(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream = bool_field(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _invalid("'stream_options' must be an object", "stream_options")
    return stream, bool(options.get("include_usage"))


def messages_field(body: dict) -> list[dict[str, Any]]:
    """`messages`, checked to be a non-empty list of objects whose `role` is one of `ROLES` and whose `tool_calls`,
    when present, is a list of objects (content is checked by each server)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _invalid(f"messages[{i}] must be an object with 'role' one of {', '.join(ROLES)}", f"messages[{i}]")
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise _invalid(f"messages[{i}].tool_calls must be a list of tool call objects", f"messages[{i}]")
    return messages


_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """Most characters of text one token of `tokenizer` stands for, bounded by its longest vocabulary entry (a
    byte-level entry spells its bytes, at least as many as the characters they make). Computed once per tokenizer."""
    if tokenizer not in _MAX_TOKEN_CHARS:
        _MAX_TOKEN_CHARS[tokenizer] = max(map(len, tokenizer.get_vocab()), default=1)
    return _MAX_TOKEN_CHARS[tokenizer]


def lone_surrogate(raw: bytes, body: Any) -> bool:
    """Whether a decoded JSON body holds a lone UTF-16 surrogate (`"\\ud800"`): valid JSON, but no tokenizer
    can encode it. Only bodies that spell a surrogate escape are walked."""
    if b"\\ud" not in raw and b"\\uD" not in raw:  # no copy of the body: it may be 16 MiB
        return False
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def tools_field(body: dict) -> list[dict] | None:
    """`tools` checked to be function tools (None when absent or empty); `tool_choice` must be auto or none.

    Neither server can force a call, so "required" and a named function are refused rather than ignored.
    """
    tools = body.get("tools")
    if tools is not None:
        ok = isinstance(tools, list) and all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
        if not ok:
            raise _invalid("'tools' must be a list of {'type': 'function', 'function': {'name', ...}}", "tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise _invalid("'tool_choice' must be 'auto' or 'none': a tool call cannot be forced here", "tool_choice")
    return tools or None


# ----- responses -----------------------------------------------------------------------------


def build_tool_calls(calls: list[ToolCall], id_prefix: str | None = None) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` entries, arguments as a JSON string; ids are `{id_prefix}_{i}`, or random `call_<hex>`."""
    return [
        {
            "id": f"{id_prefix}_{i}" if id_prefix else f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for i, call in enumerate(calls)
    ]


def assistant_message(text: str, tools: list | None, id_prefix: str | None = None) -> dict[str, Any]:
    """The assistant message of generated `text`; with `tools`, its `<tool_call>` blocks become `tool_calls`.

    Without tools, or when no block parses, `content` is the text unchanged; with calls it is the text
    around them, stripped (None when nothing is left). `id_prefix` as in `build_tool_calls`.
    """
    content, calls = parse_tool_calls(text) if tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = build_tool_calls(calls, id_prefix)
    return message


def finish_reason(message: dict[str, Any], reason: str) -> str:
    """The choice's finish reason: "tool_calls" when the message calls tools, else the engine's `reason`."""
    return "tool_calls" if message.get("tool_calls") else reason


def tool_call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`tool_calls` as a streamed delta carries them: each with its position as `index`."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The `usage` block."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_list(model_id: str, **card: Any) -> dict[str, Any]:
    """The `GET /models` answer listing one model; `card` adds fields to its entry."""
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "slime", **card}],
    }


def sse_event(data: dict) -> bytes:
    """One server-sent event carrying `data` as JSON; a stream ends with `SSE_DONE`."""
    return f"data: {json.dumps(data)}\n\n".encode()
