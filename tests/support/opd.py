"""On-policy distillation helpers: the teacher's log-probs from a plain forward pass, prompts as the rollout
tokenizes them (the teacher model is the `teacher_dir` fixture)."""

from __future__ import annotations

import torch


def teacher_forward_log_probs(model, tokens: list[int], response_length: int, temperature: float) -> list[float]:
    """log softmax(logits / T) of each response token given its prefix, from a plain forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float() / temperature
    picked = logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)
    return picked[-response_length:].tolist()


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """The prompt as the rollout tokenizes it (`--apply-chat-template`)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]
