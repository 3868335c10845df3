"""A coding agent written against the `anthropic` client, trained with RL on problems whose reward is the share of
their tests its code passes. The code runs in slime's local sandbox (`slime.agent.sandbox.LocalSandbox`).

    PYTHONPATH=examples/coding_agent_rl python train.py ... --agent-function-path agent.run --custom-rm-path agent.reward_func

`run` is given the base URL of one session of slime's trajectory proxy and talks to its Anthropic Messages route.
The model gets the problem and writes a solution in a ```python block; the agent runs the problem's tests on it in
a fresh sandbox and, while some fail, sends the report back and asks for a fix, for at most `MAX_TURNS` model turns.
It returns the last code the model wrote. `reward_func` runs the tests on that code again, in a sandbox of its own.

A problem's label holds its tests, one `expression == expected` a line (`add(1, 2) == 3`). The sandbox evaluates
the expressions only; a test passes when the expression's value is a literal of builtin types that has the expected
literal's type (inside lists and tuples too) and equals it, judged in the agent's process. So code that returns an
object claiming to equal everything passes nothing, and code that rewrites the test runner it shares an interpreter
with cannot forge a pass: the expected values never reach the sandbox.
"""

from __future__ import annotations

import ast
import json
import re
import sys

import anthropic

from slime.agent.sandbox import LocalSandbox, SandboxLimits
from slime.utils.types import Sample

MAX_TURNS = 3
SYSTEM_PROMPT = "Solve the problem in Python. Reply with the complete solution in one ```python code block."
NO_CODE = "Reply with the complete solution in one ```python code block."
# Per test run: the solution and all its tests together.
LIMITS = SandboxLimits(wall_time_s=10, cpu_time_s=10, memory_mb=512, max_output_bytes=8192, max_processes=8)
# What the proxy answers when a session has used its budget (--max-turns, the context limit).
BUDGET_ERRORS = ("max_turns_exceeded", "context_length_exceeded")
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)

# Runs in the sandbox: loads solution.py and evaluates each expression of expressions.txt (the tests without their
# expected values), then prints, tagged, each value as a literal (or the error). The solution runs in this same
# interpreter and may rewrite any of it, so nothing here is trusted: the agent's process parses the values and
# compares them with the expected ones, which never enter the sandbox. Forging a pass takes the right value.
RESULTS_TAG = "slime-test-results "
RUNNER = r"""
import json
PLAIN = (int, float, complex, str, bytes, bool, type(None))


def plain(value):
    kind = type(value)
    if kind in (list, tuple, set, frozenset):
        return all(plain(item) for item in value)
    if kind is dict:
        return all(plain(key) and plain(item) for key, item in value.items())
    return kind in PLAIN


expressions = [line for line in open("expressions.txt").read().splitlines() if line.strip()]
names = {}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), names)
    loaded = True
except BaseException as error:
    print(f"solution.py failed to load: {type(error).__name__}: {error}")
    loaded = False
results = []
for expression in expressions:
    if not loaded:
        results.append(["error", "solution.py did not load"])
        continue
    try:
        value = eval(expression, names)
        if plain(value):
            results.append(["value", repr(value)])
        else:
            results.append(["error", f"returned a {type(value).__name__}, which is no literal of builtin types"])
    except BaseException as error:
        results.append(["error", f"{type(error).__name__}: {error}"])
print()
print(RESULTS_TAG + json.dumps(results))
""".replace("RESULTS_TAG", repr(RESULTS_TAG))


def extract_code(text: str) -> str | None:
    """The last ```python block of a reply (an unclosed last block counts: the turn may end at max_tokens)."""
    blocks = _FENCE.findall(text)
    return blocks[-1].strip() + "\n" if blocks else None


def parse_tests(label: str) -> list[str]:
    """A problem's tests, one `expression == expected` a line.

    Raises:
        ValueError: A line is not `expression == literal`.
    """
    tests = [line.strip() for line in label.splitlines() if line.strip()]
    for line in tests:
        expression, _, expected = line.rpartition(" == ")
        try:
            ast.literal_eval(expected)
            valid = bool(expression)
        except (ValueError, SyntaxError):
            valid = False
        if not valid:
            raise ValueError(f"test {line!r} is not `expression == literal` (e.g. `add(1, 2) == 3`)")
    return tests


def same(got, want) -> bool:
    """Whether `got` has `want`'s builtin type, inside lists and tuples too, and equals it."""
    if type(got) is not type(want):
        return False
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    return got == want


def _outcomes(line: str, count: int) -> list[list[str]] | None:
    """The runner's `[kind, text]` per test from its tagged line, or None when the line is not that."""
    try:
        outcomes = json.loads(line[len(RESULTS_TAG) :])
    except ValueError:
        return None
    valid = isinstance(outcomes, list) and len(outcomes) == count
    if not valid or not all(
        isinstance(o, list) and len(o) == 2 and all(isinstance(t, str) for t in o) for o in outcomes
    ):
        return None
    return outcomes


def _score(test: str, kind: str, text: str) -> tuple[bool, str]:
    """Whether one test passed, and its report line; `kind`/`text` are the runner's (untrusted) outcome."""
    expected = ast.literal_eval(test.rpartition(" == ")[2])
    if kind != "value":
        return False, f"FAIL {test}: {text}"
    try:
        got = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, f"FAIL {test}: got {text[:200]}"
    if same(got, expected):
        return True, f"PASS {test}"
    return False, f"FAIL {test}: got {text[:200]}"


async def run_tests(code: str, tests: list[str], limits: SandboxLimits = LIMITS) -> tuple[int, str]:
    """Run `tests` on `code` in a fresh sandbox with `limits`: (tests passed, the report: the solution's output,
    then a PASS or FAIL line per test). The sandbox only evaluates the expressions; the values are judged here,
    against expected values it never sees. A solution that crashes, hangs or leaves no results passes none."""
    async with LocalSandbox(limits) as sb:
        await sb.write_file("solution.py", code)
        await sb.write_file("expressions.txt", "\n".join(t.rpartition(" == ")[0] for t in tests) + "\n")
        await sb.write_file("runner.py", RUNNER)
        _, stdout, stderr = await sb.exec(f"{sys.executable} -I runner.py", timeout=int(limits.wall_time_s))
    lines = stdout.splitlines()
    tagged = [i for i, line in enumerate(lines) if line.startswith(RESULTS_TAG)]
    outcomes = _outcomes(lines[tagged[-1]], len(tests)) if tagged else None
    if outcomes is None:
        return 0, (stdout.strip() + "\n" + stderr.strip()).strip()
    scored = [_score(test, kind, text) for test, (kind, text) in zip(tests, outcomes)]
    output = "\n".join(line for i, line in enumerate(lines) if i not in tagged).strip()
    report = "\n".join(([output] if output else []) + [line for _, line in scored])
    return sum(passed for passed, _ in scored), report


def problem_text(prompt: str | list[dict]) -> str:
    """The problem: the prompt itself, or the text of its user messages."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt if m.get("role") == "user")


async def run(base_url: str, sample: Sample, sampling_params: dict) -> str | None:
    """Write code until the tests pass or the turns run out; returns the last code written (None if none)."""
    tests = parse_tests(sample.label)
    messages: list[dict] = [{"role": "user", "content": problem_text(sample.prompt)}]
    code = None
    async with anthropic.AsyncAnthropic(
        base_url=base_url.removesuffix("/v1"), api_key="slime", max_retries=0
    ) as client:
        try:
            for _ in range(MAX_TURNS):
                reply = await client.messages.create(
                    model="policy",
                    system=SYSTEM_PROMPT,
                    max_tokens=int(sampling_params.get("max_new_tokens") or 512),
                    messages=messages,
                )
                text = "".join(block.text for block in reply.content if block.type == "text")
                written = extract_code(text)
                if written is None:
                    feedback = NO_CODE
                else:
                    code = written
                    passed, report = await run_tests(code, tests)
                    if passed == len(tests):
                        break
                    feedback = f"{passed} of {len(tests)} tests pass:\n{report}\nFix the code."
                messages += [
                    {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]},
                    {"role": "user", "content": feedback},
                ]
        except anthropic.BadRequestError as error:  # the session's budget is spent: the last code stands
            if not any(reason in str(error) for reason in BUDGET_ERRORS):
                raise
    return code


async def reward_func(args, sample: Sample, **kwargs) -> float:
    """The share of the problem's tests the agent's final code passes (0 without code)."""
    code = (sample.metadata or {}).get("agent_answer")
    if not code:
        return 0.0
    tests = parse_tests(sample.label)
    passed, _ = await run_tests(code, tests)
    return passed / len(tests)
