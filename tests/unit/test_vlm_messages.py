"""Image parts of chat messages (slime.agent.chat_turns) and Anthropic image blocks (slime.agent.anthropic_messages)."""

from __future__ import annotations

import pytest

from slime.agent import anthropic_messages as wire
from slime.agent.chat_turns import content_parts, message_images, template_messages
from slime.utils.openai_protocol import OpenAIError

URL = "data:image/png;base64,AAAA"


def test_content_parts_and_message_images_keep_the_images_in_order():
    content = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": URL}}, {"type": "image", "image": "b.png"}]  # fmt: skip
    assert content_parts(content) == ("a", [URL, "b.png"])
    assert content_parts("plain") == ("plain", []) and content_parts(None) == ("", [])
    messages = [{"role": "user", "content": content}, {"role": "tool", "content": [{"type": "image_url", "image_url": URL}]}]  # fmt: skip
    assert message_images(messages) == [("messages[0].content[1]", URL), ("messages[0].content[2]", "b.png"),
                                        ("messages[1].content[0]", URL)]  # fmt: skip
    assert message_images(messages, first=1) == [("messages[1].content[0]", URL)]
    # The template gets one bare image part per image, where it was.
    assert template_messages(messages)[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]  # fmt: skip
    assert template_messages([{"role": "user", "content": [{"type": "text", "text": "x"}]}])[0]["content"] == "x"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "image_url", "image_url": {}}], "an image part must hold its image"),
        ([{"type": "image", "image": "a.png"}, {"type": "audio"}], "text': ...} and image parts"),
    ],
)
def test_bad_image_parts_are_refused(content, message):
    with pytest.raises(ValueError, match=message):
        content_parts(content)


def test_anthropic_image_blocks_become_image_url_parts():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}}
    body = {"messages": [
        {"role": "user", "content": [image, {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": "a square"},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "zoom"}, image]},
            {"type": "tool_result", "tool_use_id": "t2", "content": [image], "is_error": True},
        ]},
    ]}  # fmt: skip
    part = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}}
    messages, origins = wire.chat_messages(body)
    assert messages == [
        {"role": "user", "content": [part, {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": "a square"},
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "zoom"}, part]},
        {"role": "tool", "tool_call_id": "t2", "content": [{"type": "text", "text": "Error: "}, part]},
    ]
    assert origins == ["messages[0]", "messages[1]", "messages[2]", "messages[2]"]
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.content\[0\]\.source must be") as refused:
        wire.chat_messages({"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert refused.value.param == "messages[0].content[0].source"
