"""DAPO reward: the final `Answer: ...` line, scored +1 / -1."""

from __future__ import annotations

import re

from .math_utils import extract_boxed_answer, is_equiv, reference_answer

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)


def extract_dapo_answer(response: str) -> str | None:
    """The text of the last `Answer: ...` line (its boxed content if it has a box), else the last boxed answer."""
    matches = _ANSWER_LINE.findall(response)
    if matches:
        answer = matches[-1].strip()
        return extract_boxed_answer(answer) or answer
    return extract_boxed_answer(response)


def compute_dapo_reward(response: str, label) -> dict:
    """Score a response the DAPO way: +1.0 for a correct final answer, -1.0 otherwise.

    Args:
        response: Model output ending with a line like `Answer: 42`.
        label: Ground truth answer.

    Returns:
        `{"score": 1.0 | -1.0, "acc": bool, "pred": str}`; `pred` is "" when no answer was found.
        Pick the scalar with `--reward-key score`.
    """
    prediction = extract_dapo_answer(response)
    correct = is_equiv(prediction, reference_answer(label))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction or ""}
