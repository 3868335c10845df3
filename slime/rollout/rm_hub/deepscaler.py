"""DeepScaleR reward: grade only what comes after the reasoning, so an unfinished think block earns nothing."""

from __future__ import annotations

from .math_utils import extract_boxed_answer, is_equiv, reference_answer

_END_OF_REASONING_MARKERS = ("</think>", "###Response")


def get_deepscaler_rule_based_reward(response: str, label) -> float:
    """1.0 when the boxed answer after `</think>` (or `###Response`) matches the label, else 0.0.

    Args:
        response: Model output with a reasoning block followed by the final solution.
        label: Ground truth answer; may contain `\\boxed{...}`, or be a list of accepted answers.

    Returns:
        1.0 or 0.0; 0.0 when no end-of-reasoning marker is present or nothing is boxed after it.
    """
    marker = next((m for m in _END_OF_REASONING_MARKERS if m in response), None)
    if marker is None:
        return 0.0
    solution = response.rsplit(marker, 1)[1]
    prediction = extract_boxed_answer(solution)
    if prediction is None:
        return 0.0
    labels = label if isinstance(label, list | tuple) else [label]
    return 1.0 if any(is_equiv(prediction, reference_answer(item)) for item in labels) else 0.0
