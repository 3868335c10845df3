"""Multiple-choice reward (GPQA style): the chosen option letter against the correct one."""

from __future__ import annotations

import re
import string

from .math_utils import extract_boxed_answer, normalize_final_answer

# Strongest signals first: an explicit "Answer: X" / "answer is X", then a lone letter. Letters must be
# upper case so that "the answer is a ..." does not read as option A. Between "answer" and the letter one
# character class, never two optional runs of spaces side by side: those backtrack polynomially ("answer" and
# 800 spaces took minutes), this is linear.
_ANSWER_PATTERNS = (
    re.compile(r"(?i:answer)(?:\s+is)?[\s:(]*([A-Z])\b\)?"),
    re.compile(r"^\s*\(?([A-Z])\)?[.:]?\s*$"),
)


def _letters(metadata: dict | None) -> str:
    choices = (metadata or {}).get("choices")
    count = len(choices) if choices else 4
    return string.ascii_uppercase[:count]


def extract_choice_letter(response: str, letters: str = "ABCD") -> str | None:
    """The option letter a response commits to: boxed, `Answer: (C)`, `The answer is C`, or a bare `C`."""
    boxed = extract_boxed_answer(response)
    if boxed is not None:
        candidate = normalize_final_answer(boxed).strip("()").upper()
        if len(candidate) == 1 and candidate in letters:
            return candidate
    for pattern in _ANSWER_PATTERNS:
        found = [letter for letter in pattern.findall(response) if letter in letters]
        if found:
            return found[-1]
    return None


def _correct_letter(label, metadata: dict | None, letters: str) -> str:
    text = str(label).strip()
    letter = text.strip("()").upper()
    if len(letter) == 1 and letter in letters:
        return letter
    choices = (metadata or {}).get("choices") or []
    for index, choice in enumerate(choices):
        if normalize_final_answer(str(choice)) == normalize_final_answer(text):
            return letters[index]
    raise ValueError(
        f"gpqa label {text!r} is neither an option letter ({', '.join(letters)}) nor one of "
        f"metadata['choices'] ({choices!r}); store the letter as the label or list the options in metadata['choices']"
    )


def compute_gpqa_reward(response: str, label, metadata: dict | None = None) -> float:
    """1.0 when the response picks the correct option, else 0.0.

    Args:
        response: Model output naming one option letter.
        label: The correct letter (`"C"`, `"(C)"`), or the correct option's text when `metadata["choices"]`
            lists the options in letter order.
        metadata: Optional sample metadata; `choices` also sets how many letters are valid (default A-D).

    Returns:
        1.0 or 0.0.
    """
    letters = _letters(metadata)
    return 1.0 if extract_choice_letter(response, letters) == _correct_letter(label, metadata, letters) else 0.0
