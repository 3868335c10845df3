"""Parse tool calls out of generated text (Hermes / Qwen format).

The model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A block
whose body is not such a JSON object is left in the text: the model did not make a usable call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# The closing tag may be missing when generation stopped right after the JSON (EOS, stop string).
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call; `arguments` is a JSON object encoded as a string, as OpenAI's API sends it."""

    name: str
    arguments: str


def _parse_block(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models encode the arguments once more
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=call["name"], arguments=json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split generated text into its plain content and its tool calls.

    Returns:
        (content, calls): `content` is the text outside the parsed blocks, stripped, or None when nothing
        is left; `calls` are in the order written. Text without a valid block comes back unchanged.
    """
    if TOOL_CALL_START not in text:
        return text, []
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[position : match.start()])
        position = match.end()
    if not calls:
        return text, []
    kept.append(text[position:])
    content = "".join(kept).strip()
    return content or None, calls
