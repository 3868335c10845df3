"""Rule-based math reward: the last boxed answer in the response against the label."""

from __future__ import annotations

from .math_utils import extract_boxed_answer, is_equiv


def reference_answer(label) -> str:
    """The label as an answer string; a label that is itself a boxed solution gives its boxed content."""
    label = str(label)
    if "\\boxed" in label or "\\fbox" in label:
        return extract_boxed_answer(label) or label
    return label


def compute_math_reward(response: str, label) -> float:
    """1.0 when the response's last `\\boxed{...}` is equivalent to `label`, else 0.0.

    Args:
        response: Model output containing a boxed final answer.
        label: Ground truth, e.g. `"\\frac{1}{2}"`, `"0.5"`, `7`, or a solution ending in `\\boxed{...}`.

    Returns:
        1.0 or 0.0 (0.0 when nothing is boxed).
    """
    return 1.0 if is_equiv(extract_boxed_answer(response), reference_answer(label)) else 0.0
