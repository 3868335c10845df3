"""Upstream slime's DAPO grader module: `compute_score`, as its retool example and plugins import it.

    from slime.rollout.rm_hub.math_dapo_utils import compute_score
    compute_score("... Answer: 42", "42")                                  # {"score": 1.0, "acc": True, "pred": "42"}
    compute_score("... Answer: \\\\boxed{42}", "42", strict_box_verify=True)

The default mode is `--rm-type dapo` (`dapo.compute_dapo_reward`); the strict mode only accepts a box at the end.
"""

from __future__ import annotations

from .dapo import compute_dapo_reward
from .math_utils import extract_boxed_answer

# The strict mode looks for the box only this far back from the end (or from the last pause token), as upstream.
STRICT_BOX_WINDOW_CHARS = 100


def compute_score(
    solution_str: str,
    ground_truth,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict:
    """Score a solution the DAPO way: +1.0 for a correct final answer, -1.0 otherwise.

    Args:
        solution_str: The model's solution (upstream's retool example passes prompt + response).
        ground_truth: The reference answer.
        strict_box_verify: Grade only the last `\\\\boxed{...}` within the last 100 characters, and accept only
            its exact text (surrounding spaces aside); otherwise grade the last `Answer: ...` line by equivalence,
            as `--rm-type dapo` does.
        pause_tokens_index: Strict mode only: the positions of the 4 pause tokens in `solution_str`; the box is
            then looked for from 100 characters before the last of them.

    Returns:
        `{"score": 1.0 | -1.0, "acc": bool, "pred": str}`; `pred` is "" when no answer was found.

    Raises:
        ValueError: `pause_tokens_index` does not hold 4 positions.
    """
    if not strict_box_verify:
        return compute_dapo_reward(solution_str, ground_truth)
    if pause_tokens_index is None:
        window = solution_str[-STRICT_BOX_WINDOW_CHARS:]
    elif len(pause_tokens_index) == 4:
        window = solution_str[max(0, pause_tokens_index[-1] - STRICT_BOX_WINDOW_CHARS) :]
    else:
        raise ValueError(
            f"pause_tokens_index must hold the positions of the 4 pause tokens, got {pause_tokens_index!r}"
        )
    prediction = extract_boxed_answer(window)
    correct = prediction is not None and prediction.strip() == str(ground_truth).strip()
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction or ""}
