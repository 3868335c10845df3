"""Loss masks for chat conversations: 1 exactly on the tokens the assistant wrote.

Assistant turns are located in the rendering of the whole conversation with the tokenizer's own chat
template. For turn i, three renders: the messages before it (its context), the same with the generation
prompt (where the model starts writing) and the messages up to and including it (the turn as the last
message, so what the model writes: the turn's text and its end-of-turn marker). For ChatML (Qwen2.5), Llama-3
and most templates all three are prefixes of the whole conversation, and the turn is what lies between the
last two.

Templates that render turns differently once later messages follow are handled as far as the turns can still
be located, and each turn is masked the way it appears inside the whole conversation: Qwen3 gives only the last
assistant turn an (empty) `<think>` block and shows the reasoning of earlier turns only until a later user query,
so an earlier turn keeps the end of what the model wrote, from its answer on; with `enable_thinking=False` the
generation prompt's empty `<think></think>` is missing from earlier turns, which keep all the model wrote after
a shorter header. Qwen3.5 thinks by default, so its generation prompt opens the `<think>` block; an earlier turn,
shown without the block, keeps the rest of what the model wrote. The messages between two assistant turns must
render the same in both places. A template that rewrites a turn's middle or end, or the messages around it, is
refused with an error rather than masked wrongly.

    generator = MultiTurnLossMaskGenerator(tokenizer)
    token_ids, loss_mask = generator.get_loss_mask(messages)
    response_length = get_response_lengths([loss_mask])[0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# `--loss-mask-type` values upstream slime accepts. Every one is handled the same way here, through the
# tokenizer's chat template, so the value only has to be one of them.
LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen", "llama")


@dataclass
class Segment:
    """A stretch of the rendered conversation; `trainable` marks text written by an assistant turn."""

    text: str
    trainable: bool


def get_response_lengths(loss_masks: list[list[int]]) -> list[int]:
    """Per mask, the number of tokens from the first masked-in one to the end (0 when none is): the
    `response_length` of a sample whose response starts at the first assistant token."""
    return [len(mask) - mask.index(1) if 1 in mask else 0 for mask in loss_masks]


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


def _longest_suffix_prefix(text: str, following: str) -> int:
    """Length of the longest suffix of `text` that `following` starts with."""
    start = text.find(following[:1])
    while 0 <= start < len(text):
        if following.startswith(text[start:]):
            return len(text) - start
        start = text.find(following[:1], start + 1)
    return 0


def _dropped_reasoning_block(full: str, header: int, generation_prompt: str, written: str) -> tuple[int, int] | None:
    """(start, end) in `full` of a turn that kept a head of the generation prompt and a tail of what the model
    wrote, when what it dropped between them is exactly one `<think>...</think>` block; None otherwise. Of the
    places the prompt may be cut, the latest wins: what the prompt wrote is context, not the model's."""
    best = None
    for cut in range(len(generation_prompt) + 1):
        if not full.startswith(generation_prompt[:cut], header):
            break
        start = header + cut
        kept = _longest_suffix_prefix(written, full[start:])
        dropped = (generation_prompt[cut:] + written[: len(written) - kept]).strip()
        if kept and dropped.startswith("<think>") and dropped.endswith("</think>") and dropped.count("<think>") == 1:
            best = (start, start + kept)
    return best


def _locate_turn(full: str, context: str, prompt: str, alone: str, consumed: int, i: int) -> tuple[int, int]:
    """Start and end, in `full`, of the text assistant turn `i` contributes to the loss (see module doc)."""
    if not (prompt.startswith(context) and alone.startswith(prompt)):
        raise ValueError(
            f"assistant turn at message {i}: the chat template's generation prompt is not how it starts this turn "
            "(rendering the messages up to the turn does not begin with the messages before it plus the generation "
            "prompt), so what the model wrote cannot be told apart; check the turn's fields against the template's "
            "options (a turn with reasoning under Qwen3's enable_thinking=False, for example)"
        )
    generation_prompt, written = prompt[len(context) :], alone[len(prompt) :]
    # The messages between the previous turn and this one render as at the end of this turn's context, even when
    # earlier turns render differently there (Qwen3 keeps the reasoning of turns after the last user query).
    header = consumed + _longest_suffix_prefix(context, full[consumed:])
    if full.startswith(generation_prompt, header):
        start = header + len(generation_prompt)
        # The turn keeps the end of what the model wrote (Qwen3 drops the <think> block of earlier turns).
        kept = _longest_suffix_prefix(written, full[start:])
        if kept:
            return start, start + kept
    else:
        # Only part of the generation prompt is there (Qwen3 with enable_thinking=False drops its empty <think>
        # block from earlier turns): the turn must then hold all the model wrote.
        start = full.find(written, header) if written else -1
        if start >= 0 and generation_prompt.startswith(full[header:start]):
            return start, start + len(written)
        # Qwen3.5 thinks by default: its generation prompt opens the <think> block, and earlier turns drop the
        # whole block (the prompt's end and the reasoning). The turn keeps the rest of what the model wrote.
        dropped_block = _dropped_reasoning_block(full, header, generation_prompt, written)
        if dropped_block is not None:
            return dropped_block
    raise ValueError(
        f"assistant turn at message {i}: the chat template renders this turn, or the messages before it, "
        "differently once later messages follow, beyond dropping text at the turn's start (as Qwen3 drops a "
        "<think> block), so the turn cannot be located in the whole conversation. Keep one assistant turn per "
        "conversation, or give the checkpoint a chat template that renders every assistant turn the same way"
    )


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
        context = _render(tokenizer, messages[:i], False, tools, kwargs)
        prompt = _render(tokenizer, messages[:i], True, tools, kwargs)
        alone = _render(tokenizer, messages[: i + 1], False, tools, kwargs)
        start, end = _locate_turn(full, context, prompt, alone, consumed, i)
        segments.append(Segment(full[consumed:start], trainable=False))
        segments.append(Segment(full[start:end], trainable=True))
        consumed = end
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
        """The module's `get_response_lengths`, kept as a method for upstream code that calls it on the generator."""
        return get_response_lengths(loss_masks)

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
