"""Loss masks for chat conversations: 1 exactly on the tokens the assistant wrote.

Assistant turns are located by rendering growing prefixes of the conversation with the tokenizer's own
chat template: the messages before turn i with the generation prompt (where the model would start
writing), and the messages up to and including turn i (where it stopped). Both must be prefixes of the
whole rendered conversation, which holds for ChatML (Qwen2.5), Llama-3 and most templates. Templates
that render a turn differently once later messages follow it (Qwen3's last-turn `<think>` block) are
refused with an error rather than masked wrongly.

    generator = MultiTurnLossMaskGenerator(tokenizer)
    token_ids, loss_mask = generator.get_loss_mask(messages)
    response_length = generator.get_response_lengths([loss_mask])[0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# `--loss-mask-type` values upstream slime accepts. Every one is handled the same way here, through the
# tokenizer's chat template, so the value only has to be one of them.
LOSS_MASK_TYPES = ("qwen", "qwen3", "distill_qwen", "llama")


@dataclass
class Segment:
    """A stretch of the rendered conversation; `trainable` marks text written by an assistant turn."""

    text: str
    trainable: bool


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: Any,
    chat_template_kwargs: dict[str, Any],
) -> str:
    kwargs = {**chat_template_kwargs, "add_generation_prompt": add_generation_prompt}
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    except Exception as e:  # jinja raises its own errors (e.g. "roles must alternate")
        raise ValueError(
            f"the chat template failed on the first {len(messages)} message(s) of the conversation "
            f"({type(e).__name__}: {e}); check the conversation's roles and fields"
        ) from e


def conversation_segments(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: Any = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[Segment]:
    """Split the rendered conversation into context and assistant segments.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        messages: The conversation: dicts with at least a `role`; it needs one `assistant` message or more.
        tools: Tool definitions for the chat template (`tools=`), or None.
        chat_template_kwargs: Extra `apply_chat_template` arguments (`--apply-chat-template-kwargs`).

    Returns:
        Segments whose texts concatenate to the whole rendered conversation, alternating context
        (`trainable=False`) and assistant turns (`trainable=True`); an assistant segment runs from the end of
        the generation prompt to the end of the turn (its end-of-turn marker included).
    """
    kwargs = dict(chat_template_kwargs or {})
    full = _render(tokenizer, messages, False, tools, kwargs)
    segments: list[Segment] = []
    consumed = 0  # characters of `full` already assigned to a segment
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start_text = _render(tokenizer, messages[:i], True, tools, kwargs)
        end_text = _render(tokenizer, messages[: i + 1], False, tools, kwargs)
        if not (full.startswith(start_text) and len(start_text) >= consumed):
            raise ValueError(
                f"assistant turn at message {i}: the chat template renders the messages before it plus the "
                "generation prompt differently from how they appear in the whole conversation, so the turn cannot "
                "be located; the template must render a conversation's history the same whatever follows it"
            )
        if not (full.startswith(end_text) and len(end_text) > len(start_text)):
            raise ValueError(
                f"assistant turn at message {i}: the chat template renders this turn differently once later "
                "messages follow it (Qwen3-style templates, for example, add a <think></think> block only to the "
                "final assistant turn), so it cannot be masked inside one sequence. Keep one assistant turn per "
                "conversation, or give the checkpoint a chat template that renders every assistant turn the same "
                "way (for Qwen3: emit the <think> block only when the turn has reasoning_content)"
            )
        segments.append(Segment(full[consumed : len(start_text)], trainable=False))
        segments.append(Segment(full[len(start_text) : len(end_text)], trainable=True))
        consumed = len(end_text)
    if not segments:
        roles = [message["role"] for message in messages]
        raise ValueError(f"the conversation has no assistant turn to train on (roles: {roles})")
    segments.append(Segment(full[consumed:], trainable=False))
    return [segment for segment in segments if segment.text]


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: Any = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int], str]:
    """Token ids of the rendered conversation and a mask that is 1 exactly on assistant tokens.

    Each segment is tokenized on its own, so no token straddles a context/assistant boundary: the
    context is tokenized as an engine tokenizes a prompt, each assistant turn as the tokens it would generate.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        messages: The conversation (see `conversation_segments`).
        tools: Tool definitions for the chat template, or None.
        chat_template_kwargs: Extra `apply_chat_template` arguments.

    Returns:
        (token ids, per-token mask, text from the first assistant token to the end).
    """
    segments = conversation_segments(tokenizer, messages, tools, chat_template_kwargs)
    encoded = tokenizer([segment.text for segment in segments], add_special_tokens=False)["input_ids"]
    tokens: list[int] = []
    mask: list[int] = []
    for segment, ids in zip(segments, encoded, strict=True):
        tokens.extend(ids)
        mask.extend([int(segment.trainable)] * len(ids))
    first = next(i for i, segment in enumerate(segments) if segment.trainable)
    return tokens, mask, "".join(segment.text for segment in segments[first:])


class MultiTurnLossMaskGenerator:
    """Upstream slime's loss-mask builder for multi-turn conversations (custom generate and SFT rollouts).

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template; the mask comes from that template.
        tokenizer_type: `--loss-mask-type`, one of `LOSS_MASK_TYPES`. Kept for upstream code: every type
            is handled by rendering the tokenizer's own template.
    """

    def __init__(self, tokenizer: Any, tokenizer_type: str = "qwen"):
        if tokenizer_type not in LOSS_MASK_TYPES:
            raise ValueError(
                f"unknown loss mask type {tokenizer_type!r} (--loss-mask-type); use one of {list(LOSS_MASK_TYPES)}"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; MultiTurnLossMaskGenerator renders conversations with it to "
                "find the assistant turns. Use a checkpoint whose tokenizer ships one (or set tokenizer.chat_template)"
            )
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type

    def get_loss_mask(
        self, messages: list[dict[str, Any]], tools: Any = None, chat_template_kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[int]]:
        """Token ids of the whole conversation and a mask of the same length, 1 on assistant tokens.

        Raises:
            ValueError: The conversation has no assistant turn, or the template cannot be masked (see module doc).
        """
        tokens, mask, _ = tokenize_conversation(self.tokenizer, messages, tools, chat_template_kwargs)
        return tokens, mask

    def get_response_lengths(self, loss_masks: list[list[int]]) -> list[int]:
        """Per mask, the number of tokens from the first masked-in one to the end (0 when none is): the
        `response_length` of a sample whose response starts at the first assistant token."""
        return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]

    def get_text_from_loss_mask(self, token_ids: list[int], loss_mask: list[int]) -> list[str]:
        """The decoded text of each run of masked-in tokens, in order (one string per assistant turn)."""
        if len(token_ids) != len(loss_mask):
            raise ValueError(f"{len(token_ids)} token ids but {len(loss_mask)} loss mask entries; they must match")
        runs: list[list[int]] = []
        for i, (token, keep) in enumerate(zip(token_ids, loss_mask)):
            if keep:
                if i == 0 or not loss_mask[i - 1]:
                    runs.append([])
                runs[-1].append(token)
        return [self.tokenizer.decode(run) for run in runs]
