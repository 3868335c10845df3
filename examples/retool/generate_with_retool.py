"""ReTool on slime: the model runs Python while it solves a math problem, and is rewarded for the right answer.

    --custom-generate-function-path generate_with_retool.generate
    --custom-rm-path generate_with_retool.reward_func

A turn that writes code, as `<code>...</code>`, a `<tool_call>` to `code_interpreter` (or `python`) with a `code`
argument, or a ```python block, has it run in `slime.agent.sandbox` (a subprocess with time, memory, output and
process limits and no network). What it prints, or an `Error: ...` line when it fails or hits a limit, comes back
as `<interpreter> ... </interpreter>` (loss mask 0) and the model goes on; a turn without code ends the sample.
The loop, the context budget and `--max-turns` come from `slime.agent.multi_turn`. The reward grades the last
`\\boxed{...}` the model wrote outside code (interpreter output does not count) with slime's math grader.

Limits per run: `RETOOL_WALL_TIME_S` (default 10 s wall and CPU time), `RETOOL_MEMORY_MB` (512),
`RETOOL_MAX_OUTPUT_BYTES` (2048 bytes of output kept for the model).
"""

from __future__ import annotations

import os
import re
import textwrap
import time

from slime.agent.multi_turn import append_observation, first_tool_call, model_turn, start_episode
from slime.agent.sandbox import SandboxLimits, run_python
from slime.rollout.rm_hub.reward_workers import (
    DEFAULT_NUM_WORKERS,
    DEFAULT_TIMEOUT_SECS,
    GradingCrash,
    GradingTimeout,
    get_reward_pool,
)
from slime.utils.types import Sample

_SECONDS = float(os.environ.get("RETOOL_WALL_TIME_S", "10"))
LIMITS = SandboxLimits(
    wall_time_s=_SECONDS,
    cpu_time_s=_SECONDS,
    memory_mb=int(os.environ.get("RETOOL_MEMORY_MB", "512")),
    max_output_bytes=int(os.environ.get("RETOOL_MAX_OUTPUT_BYTES", "2048")),
    max_processes=8,
    allow_network=False,
)
TOOL_NAMES = ("code_interpreter", "python")
# Turns stop right after the code; the default rollout sends no_stop_trim, so the closing tag stays in the text.
STOP = ["</code>", "</tool_call>"]
_CODE_TAG = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The code a turn asks to run: a `<tool_call>` first, then the last `<code>` block, then the last ```python
    block (a fence inside `<code>` is unwrapped); None when there is none."""
    call = first_tool_call(text, TOOL_NAMES)
    if call is not None and isinstance(call[1].get("code"), str):
        return call[1]["code"]
    blocks = _CODE_TAG.findall(text)
    if blocks:
        fenced = _FENCE.findall(blocks[-1])
        code = fenced[-1] if fenced else blocks[-1]
    else:
        fenced = _FENCE.findall(text)
        if not fenced:
            return None
        code = fenced[-1]
    return textwrap.dedent(code).strip("\n")


async def interpreter(code: str, limits: SandboxLimits = LIMITS) -> str:
    """Run `code` in the sandbox; the observation holds what it printed, or the error it ended with."""
    result = await run_python(code, limits)
    return f"\n<interpreter>\n{result.as_tool_message().rstrip()}\n</interpreter>\n"


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """Custom generate function: model turns and code runs until a turn without code, `--max-turns` or a full
    context."""
    episode = start_episode(args, sample)
    params = {**sampling_params, "stop": [*(sampling_params.get("stop") or []), *STOP]}
    runs = 0
    while not episode.done:
        code = extract_code(await model_turn(args, episode, params))
        if code is None or episode.done:
            break
        started = time.perf_counter()
        observation = await interpreter(code)
        sample.non_generation_time += time.perf_counter() - started
        runs += 1
        if not append_observation(episode, observation):
            break
    sample.metadata = {**sample.metadata, "tool_calls": runs}
    return sample


_NOT_AN_ANSWER = re.compile(
    r"<interpreter>.*?</interpreter>|<code>.*?</code>|<tool_call>.*?</tool_call>|```.*?```", re.DOTALL
)


def answer_text(response: str) -> str:
    """The response without the interpreter's output and without code: where the model's answer may be."""
    return _NOT_AN_ANSWER.sub("", response)


async def reward_func(args, sample: Sample, **kwargs) -> float:
    """1.0 when the last `\\boxed{...}` of the model's text (code and interpreter output left out) equals
    `sample.label` (slime's `math` grader, in a worker process under `--rm-timeout-secs`), else 0.0."""
    num_workers = getattr(args, "rm_num_workers", None) or DEFAULT_NUM_WORKERS
    timeout = getattr(args, "rm_timeout_secs", None) or DEFAULT_TIMEOUT_SECS
    try:
        return float(
            await get_reward_pool(num_workers).grade("math", answer_text(sample.response), sample.label, timeout)
        )
    except (GradingTimeout, GradingCrash):  # an answer too costly to grade scores as a wrong one
        return 0.0
