"""Final-answer extraction and equivalence checks for math rewards.

Three steps, each usable on its own:
1. `extract_boxed_answer`: pull the last `\\boxed{...}` out of a response.
2. `normalize_final_answer`: strip the LaTeX dressing and units that do not change the value.
3. `is_equiv`: string match, then exact number match, then a guarded sympy check for expressions.
"""

from __future__ import annotations

import re
import signal
import threading
from fractions import Fraction

import sympy
from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

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

_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_INT_FRACTION = re.compile(r"(-?\d+)/(-?\d+)")
_LATEX_INT_FRACTION = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_SIMPLE_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*=\s*(.+)$")

SYMPY_TIMEOUT_SECONDS = 2.0
_MAX_SYMPY_CHARS = 200
_MAX_EXPONENT = 1000


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


_LATEX_TO_SYMPY = {
    "\\cdot": "*",
    "\\times": "*",
    "\\div": "/",
    "\\pi": "pi",
    "\\sin": "sin",
    "\\cos": "cos",
    "\\tan": "tan",
    "\\ln": "log",
    "\\log": "log",
    "\\exp": "exp",
}
_SYMPY_FUNCTIONS = {"sqrt": sympy.sqrt, "pi": sympy.pi, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan}
_SYMPY_FUNCTIONS.update({"log": sympy.log, "exp": sympy.exp})


def _latex_to_sympy_text(answer: str) -> str | None:
    """Rewrite a normalized LaTeX answer as a sympy expression string, or None if it uses anything else.

    Only digits, single-letter variables, + - * / ^ ( ) and a few known functions survive. This
    allowlist matters: `parse_expr` evaluates Python, and the answer comes from a model.
    """
    out = []
    i = 0
    while i < len(answer):
        if answer.startswith("\\frac{", i) or answer.startswith("\\sqrt", i):
            is_frac = answer.startswith("\\frac", i)
            i += 5
            root_index = None
            if not is_frac and answer.startswith("[", i):
                close = answer.find("]", i)
                if close < 0:
                    return None
                root_index = _latex_to_sympy_text(answer[i + 1 : close])
                if root_index is None:
                    return None
                i = close + 1
            first = _read_brace_group(answer, i) if answer.startswith("{", i) else None
            if first is None:
                return None
            first_text = _latex_to_sympy_text(first[0])
            i = first[1]
            if first_text is None:
                return None
            if is_frac:
                second = _read_brace_group(answer, i) if answer.startswith("{", i) else None
                second_text = _latex_to_sympy_text(second[0]) if second else None
                if second_text is None:
                    return None
                i = second[1]
                out.append(f"(({first_text})/({second_text}))")
            elif root_index is not None:
                out.append(f"(({first_text})**(1/({root_index})))")
            else:
                out.append(f"sqrt({first_text})")
            continue
        if answer[i] == "\\":
            command = next((c for c in _LATEX_TO_SYMPY if answer.startswith(c, i)), None)
            if command is None:
                return None
            out.append(f" {_LATEX_TO_SYMPY[command]} ")
            i += len(command)
            continue
        out.append(answer[i])
        i += 1
    text = "".join(out).replace("{", "(").replace("}", ")").replace("^", "**")
    if not re.fullmatch(r"[0-9A-Za-z+\-*/().\s]*", text):
        return None
    for name in re.findall(r"[A-Za-z]+", text):
        if len(name) > 1 and name not in _SYMPY_FUNCTIONS:
            return None
    return text


def _exponent_load(expr: sympy.Basic) -> float:
    """Largest product of numeric exponents stacked on one path, e.g. `((2^10)^10)^10` → 1000.

    Inner loads are checked first, so evaluating a numeric exponent here is always cheap.
    """
    load = 1.0
    for arg in expr.args:
        load = max(load, _exponent_load(arg))
        if load > _MAX_EXPONENT:
            return load
    if isinstance(expr, sympy.Pow):
        exponent = abs(float(expr.exp)) if expr.exp.is_number else 1.0
        load = max(load, exponent * _exponent_load(expr.base))
    return load


_TRANSFORMATIONS = standard_transformations + (implicit_multiplication_application,)


def _parse_guarded(text: str) -> sympy.Expr | None:
    """Parse without evaluating, reject huge or stacked powers (they can take forever), then evaluate."""
    local_dict = dict(_SYMPY_FUNCTIONS)
    local_dict.update({name: sympy.Symbol(name) for name in re.findall(r"[A-Za-z]+", text) if len(name) == 1})
    raw = parse_expr(text, local_dict=local_dict, transformations=_TRANSFORMATIONS, evaluate=False)
    if _exponent_load(raw) > _MAX_EXPONENT:
        return None
    return parse_expr(text, local_dict=local_dict, transformations=_TRANSFORMATIONS)


class _SympyTimeout(Exception):
    pass


def _raise_timeout(signum, frame):
    raise _SympyTimeout(f"sympy took longer than {SYMPY_TIMEOUT_SECONDS} s")


def _sympy_equal(first: str, second: str) -> bool:
    first_text, second_text = _latex_to_sympy_text(first), _latex_to_sympy_text(second)
    if not first_text or not second_text or max(len(first_text), len(second_text)) > _MAX_SYMPY_CHARS:
        return False
    first_expr, second_expr = _parse_guarded(first_text), _parse_guarded(second_text)
    if first_expr is None or second_expr is None:
        return False
    difference = first_expr - second_expr
    return difference == 0 or sympy.simplify(difference) == 0


def _sympy_equal_with_timeout(first: str, second: str) -> bool:
    """`_sympy_equal` under a SIGALRM deadline when possible; any sympy failure counts as not equal.

    Signals only work on the main thread; elsewhere the size and exponent guards in `_parse_guarded`
    are what keep sympy fast.
    """
    use_alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    previous_handler = None
    if use_alarm:
        previous_handler = signal.signal(signal.SIGALRM, _raise_timeout)
        signal.setitimer(signal.ITIMER_REAL, SYMPY_TIMEOUT_SECONDS)
    try:
        return bool(_sympy_equal(first, second))
    except Exception:  # _SympyTimeout, and anything sympy raises on odd input
        return False
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_handler or signal.SIG_DFL)


def is_equiv(prediction: str | None, reference: str | None) -> bool:
    """Whether two final answers denote the same value.

    Checks, in order: normalized strings equal; both are plain numbers with the same exact value
    (`0.5`, `1/2`, `\\frac{1}{2}`); sympy finds their difference simplifies to 0 (`2\\sqrt{2}` vs `\\sqrt{8}`).
    Never raises; sympy is bounded by guards and a timeout.

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
    return _sympy_equal_with_timeout(first, second)
