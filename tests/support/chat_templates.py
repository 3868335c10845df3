"""Chat templates of other model families, on the tiny model's tokenizer, and a conversation to render with them:
for the loss-mask tests (tests/integration/test_multi_turn.py, tests/unit/test_upstream_compat.py) and the examples' turn layouts."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from support.tiny_model import build_tokenizer

# Qwen2.5-style ChatML: a default system prompt when there is none, tool results as user turns.
QWEN25_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "think step by step, then answer."},
    {"role": "user", "content": "What is 12 + 34?"},
    {"role": "assistant", "content": "The answer is 46."},
    {"role": "tool", "content": "0123456789"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "and 1 + 2?"},
    {"role": "assistant", "content": "3"},
]


def use_llama3_template(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """`tokenizer` with Llama 3's header and end-of-turn special tokens, its BOS token and LLAMA3_TEMPLATE."""
    tokenizer.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def template_tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    """The tiny tokenizer under its own template ("tiny"), QWEN25_TEMPLATE ("qwen2.5") and Llama 3's ("llama3")."""
    qwen25 = build_tokenizer()
    qwen25.chat_template = QWEN25_TEMPLATE
    return {"tiny": build_tokenizer(), "qwen2.5": qwen25, "llama3": use_llama3_template(build_tokenizer())}
