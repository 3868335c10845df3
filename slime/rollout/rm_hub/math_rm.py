"""Rule-based math reward: the last boxed answer in the response against the label."""

from __future__ import annotations

from .math_utils import grade_answer_verl


def compute_math_reward(response: str, label) -> float:
    """1.0 when the response's last `\\boxed{...}` is equivalent to `label`, else 0.0.

    Args:
        response: Model output containing a boxed final answer.
        label: Ground truth, e.g. `"\\frac{1}{2}"`, `"0.5"`, `7`, or a solution ending in `\\boxed{...}`.

    Returns:
        1.0 or 0.0 (0.0 when nothing is boxed or the label is empty).
    """
    return 1.0 if grade_answer_verl(response, label) else 0.0
