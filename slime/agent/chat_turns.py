"""Token ids of a chat turn, from the tokenizer's own chat template, without re-tokenizing what the model wrote.

A conversation's tokens are built turn by turn: the first prompt is the template's rendering of the first
messages; after that, each model turn is followed by `continuation_ids`, the tokens the template puts after an
assistant turn's content (its turn terminator, the new tool / user messages, the next generation prompt). The
sampled tokens themselves are kept exactly as the engine returned them: re-rendering a finished conversation
and tokenizing it again gives other tokens (merges across the turn boundary, templates that rewrite earlier
assistant turns), and training on those does not converge.

Vision-language models: a message's content may hold image parts (OpenAI's `{"type": "image_url", "image_url":
{"url": ...}}` or HF's `{"type": "image", "image": ...}`); the template gets each as `{"type": "image"}` and writes the
model's image placeholder once, and `message_images` gives the images in the same order, for the caller to expand
the placeholders (`slime.utils.data.VisionPrompter`) and send the images along.
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


def image_reference(part: Any) -> Any | None:
    """The image of a content part: an OpenAI `image_url` part's URL (a `data:` URL, base64 or a local path), an HF
    `image` part's `image` (also a PIL image); None for any other part.

    Raises:
        ValueError: an image part that holds no image.
    """
    if not isinstance(part, dict) or part.get("type") not in ("image_url", "image"):
        return None
    value = part.get("image_url") if part["type"] == "image_url" else part.get("image")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None or value == "":
        raise ValueError(
            "an image part must hold its image: {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}"
            " or {'type': 'image', 'image': ...}"
        )
    return value


def content_parts(content: Any) -> tuple[str, list[Any]]:
    """The text of a message `content` and the images in it (`image_reference` of each image part, in order).

    Raises:
        ValueError: `content` is not a string, None or a list of text and image parts.
    """
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in content
    ):
        return content_text(content), []
    text, images = [], []
    for part in content:
        image = image_reference(part)
        if image is not None:
            images.append(image)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        else:
            raise ValueError(
                "content must be a string, a list of {'type': 'text', 'text': ...} and image parts, or null"
            )
    return "".join(text), images


def message_images(messages: list[dict[str, Any]], first: int = 0) -> list[tuple[str, Any]]:
    """Every image of `messages[first:]`, in the order the chat template writes their placeholders, as (where,
    image): `where` names the part (`messages[2].content[1]`) for error messages."""
    found = []
    for i, message in enumerate(messages[first:], start=first):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            image = image_reference(part)
            if image is not None:
                found.append((f"messages[{i}].content[{j}]", image))
    return found


def _template_content(content: Any) -> str | list[dict[str, str]]:
    """Content as chat templates take it: its text, or (with images) text and `{"type": "image"}` parts in order."""
    text, images = content_parts(content)
    if not images:
        return text
    return [
        {"type": "image"} if image_reference(part) is not None else {"type": "text", "text": part["text"]}
        for part in content
    ]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style messages as chat templates expect them: content as text (or text and image parts), tool-call
    arguments as mappings."""
    out = []
    for message in messages:
        message = {**message, "content": _template_content(message.get("content"))}
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
