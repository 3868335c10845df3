"""A calculator agent written against the `openai` client only; slime trains the model behind it.

    PYTHONPATH=examples/openai_agent python train.py ... --agent-function-path agent.run --custom-rm-path reward.reward_func

`run` is given the `base_url` of one session of slime's trajectory proxy, an OpenAI-compatible endpoint.
It offers a `calculator` tool, runs the calls the model makes here in plain Python, sends the results back
as `tool` messages, and asks again when a reply holds no number, for at most `MAX_TURNS` model turns. The
proxy records the session token for token: the model's tokens are trained on, the rest is context.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

import openai

MAX_TURNS = 3
SYSTEM_PROMPT = "Solve the problem. Call the calculator tool for arithmetic. Reply with the final answer as a number."
REMINDER = "Reply with the final answer as a number, or call the calculator tool."
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 34) * 2"}},
            "required": ["expression"],
        },
    },
}
# What the proxy answers when a session has used its budget (--max-turns, the context limit).
BUDGET_ERRORS = ("max_turns_exceeded", "context_length_exceeded")

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_EXPRESSION_CHARS = 200  # keeps the parse and the numbers small whatever the model writes
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, or a text starting with "error:" the model can read.

    The expression is parsed with `ast` and only numbers, `+ - * /`, unary signs and parentheses are
    evaluated: nothing the model writes is run as code.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return f"error: the expression is longer than {_MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        return f"error: {expression!r} is not an arithmetic expression"
    except ZeroDivisionError:
        return "error: division by zero"
    except (ValueError, OverflowError) as error:
        return f"error: {error}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 10) if isinstance(value, float) else value)


def run_tool(name: str, arguments: str) -> str:
    """The result of one tool call: `name` and its JSON `arguments` as the model wrote them."""
    if name != CALCULATOR_TOOL["function"]["name"]:
        return f"error: there is no tool {name!r}; the only tool is calculator"
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("expression"), str):
        return 'error: the arguments must be a JSON object like {"expression": "12 + 34"}'
    return calculate(parsed["expression"])


def tool_message(call: Any) -> dict[str, str]:
    """The `tool` message answering one of the reply's `tool_calls` (an openai tool-call object)."""
    function = getattr(call, "function", None)  # custom (non-function) tool calls have none
    if function is None:
        return {"role": "tool", "tool_call_id": call.id, "content": "error: the only tool is the calculator function"}
    return {"role": "tool", "tool_call_id": call.id, "content": run_tool(function.name, function.arguments)}


def final_answer(content: str | None) -> str | None:
    """The reply as the final answer when it holds a number, else None."""
    return content.strip() if content and _NUMBER.search(content) else None


def first_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system prompt and the sample's prompt (a text, or chat messages from the dataset)."""
    user = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return [{"role": "system", "content": SYSTEM_PROMPT}] + user


async def run(base_url: str, sample: Any, sampling_params: dict[str, Any]) -> str | None:
    """`--agent-function-path`: drive one chat at `base_url` and return the final answer (None without one).

    Args:
        base_url: The session's OpenAI endpoint (ends in /v1); any API key works.
        sample: The slime `Sample`; only `sample.prompt` is read.
        sampling_params: The `--rollout-*` sampling settings; the proxy already applies them to every request
            that leaves them out, so this agent does not pass any.
    """
    # No retries: a failed turn fails the sample, and the session's engine is the same on a retry.
    client = openai.AsyncOpenAI(base_url=base_url, api_key="slime", max_retries=0)
    messages = first_messages(sample.prompt)
    try:
        for _ in range(MAX_TURNS):
            completion = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR_TOOL]
            )
            reply = completion.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))  # sent back as returned, as the proxy requires
            if reply.tool_calls:
                messages += [tool_message(call) for call in reply.tool_calls]
            elif (answer := final_answer(reply.content)) is not None:
                return answer
            else:
                messages.append({"role": "user", "content": REMINDER})
    except openai.BadRequestError as error:
        if error.code not in BUDGET_ERRORS:
            raise
    finally:
        await client.close()
    return None
