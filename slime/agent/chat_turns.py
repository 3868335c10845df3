"""Token ids of a chat turn, from the tokenizer's own chat template, without re-tokenizing what the model wrote.

A conversation's tokens are built turn by turn: the first prompt is the template's rendering of the first
messages; after that, each model turn is followed by `continuation_ids`, the tokens the template puts after an
assistant turn's content (its turn terminator, the new tool / user messages, the next generation prompt). The
sampled tokens themselves are kept exactly as the engine returned them: re-rendering a finished conversation
and tokenizing it again gives other tokens (merges across the turn boundary, templates that rewrite earlier
assistant turns), and training on those does not converge.
"""

from __future__ import annotations

import json
from typing import Any

# Stands in for the model's text when rendering what follows a turn: the template's output after it is the delta.
_PLACEHOLDER = "SLIMEASSISTANTPLACEHOLDER"


class ChatTemplateError(ValueError):
    """The chat template rejected the messages, or renders them in a way the turn delta cannot be taken from."""


def content_text(content: Any) -> str:
    """The text of a message `content`: a string, a list of OpenAI text parts, or None (empty).

    Raises:
        ValueError: `content` is some other shape, or holds non-text parts.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise ValueError("content must be a string, a list of {'type': 'text', 'text': ...} parts, or null")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages as chat templates expect them: content as text, tool-call arguments as mappings."""
    out = []
    for message in messages:
        message = {**message, "content": content_text(message.get("content"))}
        calls = []
        for call in message.get("tool_calls") or []:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass  # not JSON: the template renders the string as it is
            calls.append({**call, "function": function})
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _render(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None, template_kwargs: dict | None) -> str:
    messages = template_messages(messages)
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )
    except Exception as error:  # jinja errors: a role order or a field the template does not accept
        raise ChatTemplateError(f"the model's chat template rejected the messages: {error}") from None


def prompt_ids(
    tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> list[int]:
    """Token ids of `messages` rendered with the chat template and the generation prompt (a first turn's prompt).

    Args:
        tools: OpenAI tool definitions, rendered by templates that support them.
        template_kwargs: Extra template variables (SGLang's `chat_template_kwargs`, e.g. `enable_thinking`).
    """
    # The template writes any BOS itself.
    return tokenizer.encode(_render(tokenizer, messages, tools, template_kwargs), add_special_tokens=False)


def continuation_text(
    tokenizer, new_messages: list[dict[str, Any]], tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> str:
    """The text the chat template writes after an assistant turn's content, up to the next generation prompt.

    It is the rendering of `[user, assistant(placeholder), *new_messages]` after the placeholder: the template's
    turn terminator, `new_messages`, and the generation prompt. A fixed placeholder turn (not the real history)
    keeps it independent of how the template rewrites earlier turns (e.g. Qwen3 drops past reasoning).

    Raises:
        ChatTemplateError: The template rejects the messages or drops the assistant content.
    """
    rendered = _render(
        tokenizer,
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PLACEHOLDER}, *new_messages],
        tools,
        template_kwargs,
    )
    position = rendered.find(_PLACEHOLDER)
    if position < 0:
        raise ChatTemplateError(
            "the model's chat template does not render an assistant message's content, so the tokens that follow a "
            "model turn cannot be taken from it; use a template that renders assistant content"
        )
    return rendered[position + len(_PLACEHOLDER) :]


def continuation_ids(
    tokenizer,
    sampled_ids: list[int],
    new_messages: list[dict[str, Any]],
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids to append after a model turn's `sampled_ids` before the next model turn.

    They are the tokens of `continuation_text`, less its first token when the model already sampled it (its
    end-of-turn token, e.g. `<|im_end|>`). A turn cut by length or a stop string has no end-of-turn token, so the
    whole terminator is added (it is template text: the caller masks it out of the loss).
    """
    ids = tokenizer.encode(continuation_text(tokenizer, new_messages, tools, template_kwargs), add_special_tokens=False)
    if sampled_ids and ids and ids[0] == sampled_ids[-1]:
        return ids[1:]
    return ids
