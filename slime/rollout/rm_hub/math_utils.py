"""Final-answer extraction and equivalence checks for math rewards.

Three steps, each usable on its own:
1. `extract_boxed_answer`: pull the last `\\boxed{...}` out of a response.
2. `normalize_final_answer`: strip the LaTeX dressing and units that do not change the value.
3. `is_equiv`: string match, then exact number match, then math-verify (sympy) for expressions.

Upstream slime's names for the same steps: `extract_answer` (1) and `grade_answer_verl` (1 then 3).

`is_equiv` is only bounded by its guards and, on the main thread, math-verify's alarm; the rollout grades
in `reward_workers`, whose processes are killed past `--rm-timeout-secs`.
"""

from __future__ import annotations

import logging
import re
import threading
from fractions import Fraction
from functools import cache

_BOX_COMMANDS = ("\\boxed", "\\fbox")

# Unit words dropped when they trail an answer ("5 cm", "30 degrees"). Single letters are left alone
# because they are usually variables.
_UNIT_WORDS = (
    "degrees",
    "degree",
    "radians",
    "centimeters",
    "centimetres",
    "millimeters",
    "kilometers",
    "meters",
    "metres",
    "inches",
    "inch",
    "feet",
    "foot",
    "yards",
    "miles",
    "mph",
    "cm",
    "mm",
    "km",
    "kg",
    "grams",
    "pounds",
    "ounces",
    "liters",
    "dollars",
    "dollar",
    "cents",
    "hours",
    "hour",
    "minutes",
    "seconds",
    "days",
    "weeks",
    "years",
    "units",
    "unit",
    "square",
    "sq",
    "cubic",
    "points",
    "people",
    "students",
    "ways",
)
_TRAILING_UNIT = re.compile(r"(?<![A-Za-z])(?:" + "|".join(_UNIT_WORDS) + r")(?:\^\{?[23]\}?)?\s*$")

# LaTeX wrappers whose argument is kept as is.
_WRAPPERS = ("\\text", "\\textbf", "\\textit", "\\mathrm", "\\mathbf", "\\mbox", "\\operatorname", "\\boxed")

# Pieces that carry no value.
_DROPPED = (
    "\\left",
    "\\right",
    "\\displaystyle",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\ ",
    "\\$",
    "$",
    "^{\\circ}",
    "^\\circ",
    "\\circ",
    "°",
    "\\%",
    "%",
)

# A short exponent only: Fraction("1e999999999") would build a billion-digit integer.
_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][+-]?\d{1,3})?")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_INT_FRACTION = re.compile(r"(-?\d+)/(-?\d+)")
_LATEX_INT_FRACTION = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_SIMPLE_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*=\s*(.+)$")

# math-verify's own per-step timeout (whole seconds, main thread only); the reward workers set it to None.
SYMPY_TIMEOUT_SECONDS: int | None = 2
_MAX_EXPONENT = 1000
# math-verify warns once that it runs without a timeout; that is on purpose off the main thread.
logging.getLogger("math_verify").setLevel(logging.ERROR)


@cache
def _math_verify():
    """math-verify and its LaTeX-only extraction config, imported on the first symbolic check: sympy's import
    (about half a second) is then paid only by the processes that grade, not by every one that imports rm_hub."""
    import math_verify
    from math_verify.parser import LatexExtractionConfig

    # Answers are LaTeX; math-verify's plain-expression extractor is not needed for them.
    return math_verify, [LatexExtractionConfig()]


def _read_brace_group(text: str, open_index: int) -> tuple[str, int] | None:
    """Return (content, index after the closing brace) for the `{` at `open_index`, or None if unbalanced."""
    depth = 0
    for i in range(open_index, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i], i + 1
    return None


def extract_boxed_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`.

    Args:
        text: A model response.

    Returns:
        The boxed content with nested braces kept, or None when there is no complete box.
    """
    if not text:
        return None
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest_index = start + len(command)
    if text.startswith("{", rest_index):
        group = _read_brace_group(text, rest_index)
        return group[0] if group else None
    if text.startswith(" ", rest_index):
        # `\boxed 5$`: the answer runs to the closing dollar or the end of the text.
        return text[rest_index:].split("$")[0].strip() or None
    return None


def _unwrap(text: str, command: str) -> str:
    """Replace every `command{X}` with `X`, keeping nested braces inside X."""
    while True:
        start = text.find(command + "{")
        if start < 0:
            return text
        group = _read_brace_group(text, start + len(command))
        if group is None:
            return text
        content, end = group
        text = text[:start] + content + text[end:]


def _brace_short_arguments(text: str) -> str:
    """`\\frac12` → `\\frac{1}{2}`, `\\sqrt3` → `\\sqrt{3}`: models often drop braces around single characters."""
    text = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)
    text = re.sub(r"\\frac(\w)(\w)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\{([^{}]*)\}(\w)", r"\\frac{\1}{\2}", text)
    return re.sub(r"\\frac(\w)\{", r"\\frac{\1}{", text)


def normalize_final_answer(answer: str) -> str:
    """Canonical string form of a final answer, so that formatting differences compare equal.

    Drops `$`, `\\left`/`\\right`, spacing commands, text wrappers, degree and percent signs, trailing unit
    words, trailing periods, thousands separators and a leading `x =`; maps `\\dfrac`/`\\tfrac` to `\\frac`.

    Args:
        answer: An extracted answer, e.g. `"\\text{5 cm}"` or `"x = \\dfrac{1}{2}"`.

    Returns:
        The normalized answer with all whitespace removed, e.g. `"5"` or `"\\frac{1}{2}"`.
    """
    answer = str(answer).strip().replace("−", "-")
    assignment = _SIMPLE_ASSIGNMENT.match(answer)
    if assignment:
        answer = assignment.group(1)
    for wrapper in _WRAPPERS:
        answer = _unwrap(answer, wrapper)
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for piece in _DROPPED:
        answer = answer.replace(piece, "")
    answer = answer.strip().rstrip(".").strip()
    # Peel units one word at a time ("5 square feet"), never down to nothing.
    while True:
        stripped = _TRAILING_UNIT.sub("", answer).strip()
        if stripped == answer or not stripped:
            break
        answer = stripped
    answer = re.sub(r"\s+", "", answer).rstrip(".")
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    answer = _brace_short_arguments(answer)
    if answer.startswith("."):
        answer = "0" + answer
    return answer


def _as_exact_number(answer: str) -> Fraction | None:
    """Exact value of a plain number: integer, decimal, `a/b` or `\\frac{a}{b}` (already normalized)."""
    if _NUMBER.fullmatch(answer):
        return Fraction(answer)
    for pattern in (_INT_FRACTION, _LATEX_INT_FRACTION):
        match = pattern.fullmatch(answer)
        if match is None:
            continue
        if pattern is _INT_FRACTION:
            numerator, denominator = match.group(1), match.group(2)
            sign = 1
        else:
            sign = -1 if match.group(1) else 1
            numerator, denominator = match.group(2), match.group(3)
        if int(denominator) == 0:
            return None
        return sign * Fraction(int(numerator), int(denominator))
    return None


def _exponent_load(expr) -> float:
    """Largest product of numeric exponents stacked on one path, e.g. `((2^10)^10)^10` → 1000.

    Inner loads are checked first, so evaluating a numeric exponent here is always cheap.
    """
    import sympy  # already loaded by math-verify's parse, which built `expr`

    if not isinstance(expr, sympy.Basic):
        return 1.0
    load = 1.0
    for arg in expr.args:
        load = max(load, _exponent_load(arg))
        if load > _MAX_EXPONENT:
            return load
    if isinstance(expr, sympy.Pow) and expr.exp.is_number:
        try:
            exponent = abs(complex(expr.exp))
        except (TypeError, ValueError):
            exponent = 1.0
        load = max(load, exponent * _exponent_load(expr.base))
    return load


def _symbolic_equal(prediction: str, reference: str) -> bool:
    """math-verify's verdict on two LaTeX answers; huge or stacked powers are refused before any evaluation."""
    # math-verify times out with SIGALRM, which only works on the main thread; elsewhere (and in the reward
    # workers, whose parent kills them instead) it runs without one.
    on_main_thread = threading.current_thread() is threading.main_thread()
    timeout = SYMPY_TIMEOUT_SECONDS if on_main_thread else None
    math_verify, latex_only = _math_verify()
    try:
        gold = math_verify.parse(f"${reference}$", latex_only, parsing_timeout=timeout)
        predicted = math_verify.parse(f"${prediction}$", latex_only, parsing_timeout=timeout)
        if not gold or not predicted:
            return False
        # parse() builds unevaluated expressions, so the guard runs before sympy computes anything.
        if any(_exponent_load(expr) > _MAX_EXPONENT for expr in (*gold, *predicted)):
            return False
        return bool(math_verify.verify(gold, predicted, timeout_seconds=timeout))
    except Exception:  # anything math-verify or sympy raise on odd input
        return False


def is_equiv(prediction: str | None, reference: str | None) -> bool:
    """Whether two final answers denote the same value.

    Checks, in order: normalized strings equal; both are plain numbers with the same exact value
    (`0.5`, `1/2`, `\\frac{1}{2}`); math-verify finds them equal (`2\\sqrt{2}` vs `\\sqrt{8}`, `\\{1,2\\}` vs
    `\\{2,1\\}`). Never raises. Powers too large to evaluate are refused up front; anything else slow is only
    stopped by math-verify's alarm on the main thread, or by running it in `reward_workers`.

    Args:
        prediction: The model's answer (already extracted), or None.
        reference: The ground-truth answer, or None.

    Returns:
        True when the answers are equivalent.
    """
    if prediction is None or reference is None:
        return False
    first, second = normalize_final_answer(prediction), normalize_final_answer(reference)
    if not first or not second:
        return False
    if first == second:
        return True
    first_number, second_number = _as_exact_number(first), _as_exact_number(second)
    if first_number is not None and second_number is not None:
        return first_number == second_number
    return _symbolic_equal(str(prediction).strip(), str(reference).strip())


def extract_answer(passage: str) -> str | None:
    """Upstream's name for `extract_boxed_answer`: the content of the last box in `passage`, or None."""
    return extract_boxed_answer(passage)


def reference_answer(label) -> str:
    """The label as an answer string; a label that is itself a boxed solution gives its boxed content."""
    label = str(label)
    if "\\boxed" in label or "\\fbox" in label:
        return extract_boxed_answer(label) or label
    return label


def grade_answer_verl(solution_str: str, ground_truth) -> bool:
    """Whether the last boxed answer of `solution_str` is equivalent to `ground_truth` (upstream's math grader).

    Args:
        solution_str: A model response with a boxed final answer.
        ground_truth: The answer (`"\\frac{1}{2}"`, `0.5`, `7`) or a solution whose last box holds it.

    Returns:
        False when nothing is boxed, the ground truth is None or empty, or the answers differ.
    """
    # Unlike upstream's `not ground_truth`, a label of 0 is still an answer.
    if ground_truth is None or str(ground_truth).strip() == "":
        return False
    return is_equiv(extract_boxed_answer(solution_str), reference_answer(ground_truth))
