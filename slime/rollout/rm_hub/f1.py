"""Token-level F1 between a response and the reference answer(s), as in SQuAD-style QA scoring."""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCTUATION = set(string.punctuation)
# A yes/no/noanswer reply is either right or wrong; partial overlap would reward "no" against "yes it is".
_CLOSED_ANSWERS = ("yes", "no", "noanswer")


def normalize_text(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _f1_single(prediction: str, reference: str) -> float:
    prediction, reference = normalize_text(prediction), normalize_text(reference)
    if (prediction in _CLOSED_ANSWERS or reference in _CLOSED_ANSWERS) and prediction != reference:
        return 0.0
    prediction_tokens, reference_tokens = prediction.split(), reference.split()
    overlap = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, label: str | list[str]) -> float:
    """Token F1 between `prediction` and `label`; with several labels, the best one counts.

    Args:
        prediction: Model answer (None scores 0).
        label: Reference answer, or a list of acceptable references.

    Returns:
        F1 in [0, 1].
    """
    if prediction is None:
        return 0.0
    labels = label if isinstance(label, list | tuple) else [label]
    return max((_f1_single(prediction, reference) for reference in labels), default=0.0)
