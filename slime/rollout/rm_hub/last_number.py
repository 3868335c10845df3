"""`--rm-type last_number`: the last number in the response equals the label.

For short-answer tasks where a small model writes "37 + 58 = 95" rather than a boxed answer.
A `\\boxed{...}` answer, when present, is preferred over the last number.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from .math_utils import extract_boxed_answer

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _to_number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def compute_last_number_reward(response: str, label: Any) -> float:
    """1.0 when the boxed answer (or else the last number) of `response` equals `label` numerically."""
    expected = _to_number(str(label).strip())
    if expected is None:
        return 0.0
    boxed = extract_boxed_answer(response)
    candidates = _NUMBER.findall(boxed if boxed is not None else response)
    if not candidates:
        return 0.0
    return float(_to_number(candidates[-1]) == expected)
