"""SFT conversations for the tests: a multi-turn conversation, its expected tokens and assistant mask, the untrained loss."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

CONVERSATION = [
    {"role": "system", "content": "think step by step, then answer."},
    {"role": "user", "content": "What is 12 + 34?"},
    {"role": "assistant", "content": "The answer is \\boxed{46}."},
    {"role": "user", "content": "and 1 + 2?"},
    {"role": "assistant", "content": "3"},
    {"role": "tool", "content": "0123456789"},
    {"role": "assistant", "content": "the quick brown fox"},
]


def expected_tokens_and_mask(tokenizer, messages):
    """Oracle from the tiny template's known layout: `<|im_start|>{role}\\n` then `{content}<|im_end|>\\n`,
    the latter trainable for assistant messages."""
    tokens, mask = [], []
    for message in messages:
        header = tokenizer(f"<|im_start|>{message['role']}\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(f"{message['content']}<|im_end|>\n", add_special_tokens=False)["input_ids"]
        tokens += header + body
        mask += [0] * len(header) + [int(message["role"] == "assistant")] * len(body)
    return tokens, mask


def write_conversations(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def refuse_advantages(args, rollout_id, data):
    """`--rollout-data-postprocess-path` of these runs: the trainer must not have computed advantages."""
    computed = sorted({"advantages", "returns"} & set(data))
    if computed:
        raise AssertionError(f"--disable-compute-advantages-and-returns is set but the trainer computed {computed}")


def initial_sft_loss(model_dir, tokenizer, messages) -> float:
    """Token-mean NLL of the untrained model on the assistant tokens, straight from transformers."""
    tokens, mask = expected_tokens_and_mask(tokenizer, messages)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].double()
    nll = -torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    weights = torch.tensor(mask[1:], dtype=torch.float64)
    return float((nll * weights).sum() / weights.sum())
