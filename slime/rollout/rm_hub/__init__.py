"""Reward functions: built-in rules picked by `--rm-type`, or a user function from `--custom-rm-path`.

Built-in types: math, deepscaler, dapo, f1, gpqa, last_number (rule based); boxed_f1 and boxed_gpqa (grade only the
last `\\boxed{...}` of the response; math, deepscaler and dapo find the boxed answer themselves);
remote_rm (HTTP server at `--rm-url`); random. A sample's `metadata["rm_type"]` overrides `--rm-type`,
so one dataset can mix reward types.

The rule-based types are graded in worker processes (`reward_workers`) under `--rm-timeout-secs`, so a
pathological answer costs at most that and never blocks the event loop; it scores as a wrong answer and is
counted in `pop_reward_metrics()["reward/timeouts"]`.

`grade_answer_verl` (upstream's math grader, from `math_utils`) is importable from here, as upstream's plugins
import it; `math_dapo_utils.compute_score` is upstream's DAPO grader.

`async_rm` / `batched_async_rm` are also called from user reward functions with namespaces they build, so every
field is read with a default.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from slime.utils.misc import load_function, maybe_await
from slime.utils.types import Sample

from .dapo import compute_dapo_reward, extract_dapo_answer
from .deepscaler import get_deepscaler_rule_based_reward
from .f1 import f1_score
from .gpqa import compute_gpqa_reward
from .last_number import compute_last_number_reward
from .math_rm import compute_math_reward
from .math_utils import extract_boxed_answer, grade_answer_verl
from .remote_rm import remote_rm
from .reward_workers import (
    GradingCrash,
    GradingTimeout,
    add_reward_seconds,
    get_reward_pool,
    pop_reward_metrics,
)

logger = logging.getLogger(__name__)

__all__ = [
    "RM_TYPES",
    "RULE_BASED_REWARDS",
    "UNGRADED_REWARDS",
    "RewardFunctionError",
    "async_rm",
    "batched_async_rm",
    "grade_answer_verl",
    "pop_reward_metrics",
    "resolve_rm_type",
    "start_reward_workers",
]

# Each takes (response, label, metadata).
RULE_BASED_REWARDS: dict[str, Callable[[str, Any, dict], float | dict]] = {
    "math": lambda response, label, metadata: compute_math_reward(response, label),
    "deepscaler": lambda response, label, metadata: get_deepscaler_rule_based_reward(response, label),
    "dapo": lambda response, label, metadata: compute_dapo_reward(response, label),
    "f1": lambda response, label, metadata: f1_score(response, label),
    "gpqa": lambda response, label, metadata: compute_gpqa_reward(response, label, metadata=metadata),
    "last_number": lambda response, label, metadata: compute_last_number_reward(response, label),
}
RM_TYPES = (*RULE_BASED_REWARDS, "remote_rm", "random")
# What an answer that could not be graded in time scores: the same as a wrong one (0.0 where not listed).
UNGRADED_REWARDS: dict[str, Callable[[str], float | dict]] = {
    "dapo": lambda response: {"score": -1.0, "acc": False, "pred": extract_dapo_answer(response) or ""},
}
BOXED_PREFIX = "boxed_"
BOXABLE_TYPES = ("f1", "gpqa")


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function and the sample, the cause is chained."""


def _valid_types_text() -> str:
    return f"{', '.join(RM_TYPES)}, " + ", ".join(BOXED_PREFIX + name for name in BOXABLE_TYPES)


def resolve_rm_type(rm_type: str) -> tuple[str, bool]:
    """Split `boxed_f1` into (`f1`, True); check that the type exists.

    Raises:
        ValueError: naming the unknown type and listing the valid ones.
    """
    base_type, boxed = rm_type, rm_type.startswith(BOXED_PREFIX)
    if boxed:
        base_type = rm_type[len(BOXED_PREFIX) :]
    if base_type not in RM_TYPES or (boxed and base_type not in BOXABLE_TYPES):
        raise ValueError(
            f"unknown reward type {rm_type!r} (from --rm-type or metadata['rm_type']); valid types: "
            f"{_valid_types_text()}. For anything else pass --custom-rm-path my_module.my_rm"
        )
    return base_type, boxed


async def _builtin_reward(args, sample: Sample, base_type: str, boxed: bool) -> float | dict:
    if base_type == "remote_rm":
        return await remote_rm(args, sample)
    if base_type == "random":
        return float(random.randint(0, 1))
    response = sample.response
    if boxed:
        response = extract_boxed_answer(response) or ""
    # Every rule-based type in a worker process, under --rm-timeout-secs: sympy or a regular expression on a
    # hostile response can run for minutes, and here it would stall every other sample of the rollout.
    pool = get_reward_pool(args.rm_num_workers)
    timeout = args.rm_timeout_secs
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    try:
        return await pool.grade(base_type, response, sample.label, timeout, metadata)
    except (GradingTimeout, GradingCrash) as error:
        logger.warning("sample index %s scored as wrong: %s", sample.index, error)
        return UNGRADED_REWARDS.get(base_type, lambda response: 0.0)(response)


def start_reward_workers(args) -> None:
    """Start the worker processes now if `args` grade with a built-in rule-based reward (`--rm-type`, no
    `--custom-rm-path`), so that the first rollout does not wait for their start-up."""
    rm_type = (args.rm_type or "").strip()
    if args.custom_rm_path or not rm_type:
        return
    try:
        base_type, _ = resolve_rm_type(rm_type)
    except ValueError:
        return  # the first answer raises it, where the rollout reports it
    if base_type in RULE_BASED_REWARDS:
        get_reward_pool(args.rm_num_workers).start()


async def async_rm(args, sample: Sample, **kwargs) -> float | dict:
    """Reward of one sample.

    Args:
        args: Reads `custom_rm_path` and `rm_type` (plus `rm_url` etc. for remote_rm).
        sample: The sample with its `response` and `label`; its own `custom_rm_path` (upstream's per-sample
            reward) takes the place of `--custom-rm-path`.
        **kwargs: Passed on to a custom reward function.

    The built-in rule-based types are graded in a worker process (`args.rm_num_workers`), each answer
    within `args.rm_timeout_secs`; past it the answer scores as a wrong one and counts in
    `pop_reward_metrics()`. Awaiting never blocks the event loop.

    Returns:
        A float, or a dict of rewards (dapo, or a custom function) to pick from with `--reward-key`.

    Raises:
        ValueError: no reward configured, or an unknown reward type.
        RewardFunctionError: the reward function raised (even SystemExit); the original error is its `__cause__`.
    """
    custom_rm_path = sample.custom_rm_path or args.custom_rm_path
    if custom_rm_path:
        rm_function = load_function(custom_rm_path)
        rm_name = f"custom reward function {custom_rm_path!r}"
    else:
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
        if not rm_type:
            raise ValueError(f"no reward function: set --rm-type ({_valid_types_text()}) or --custom-rm-path")
        base_type, boxed = resolve_rm_type(rm_type)
        rm_name = f"reward type {rm_type!r}"
    started = time.perf_counter()
    try:
        if custom_rm_path:
            return await maybe_await(rm_function(args, sample, **kwargs))
        return await _builtin_reward(args, sample, base_type, boxed)
    except asyncio.CancelledError:
        raise
    except BaseException as error:  # SystemExit too: escaping a task, it would stop the shared event loop
        raise RewardFunctionError(
            f"{rm_name} failed on sample index {sample.index}: {type(error).__name__}: {error}"
        ) from error
    finally:
        add_reward_seconds(time.perf_counter() - started)


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list[float | dict]:
    """Rewards of several samples, one per sample, in order.

    With `args.group_rm` and a custom reward function, the function is called once with the whole
    list (`rm(args, samples) -> list`), e.g. to rank responses against each other. Otherwise every
    sample is scored by `async_rm`, concurrently.

    Args:
        args: See `async_rm`; also reads `group_rm`.
        samples: Samples to score, usually the responses to one prompt.
        **kwargs: Passed on to a custom reward function.

    Returns:
        One reward per sample.

    Raises:
        ValueError: under `group_rm` with a group function, a sample names another reward (its `custom_rm_path`),
            which the group function would silently take the place of.
    """
    custom_rm_path = args.custom_rm_path
    if not (args.group_rm and custom_rm_path):
        return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))

    indices = [sample.index for sample in samples]
    others = {s.custom_rm_path for s in samples if s.custom_rm_path and s.custom_rm_path != custom_rm_path}
    if others:
        named = [s.index for s in samples if s.custom_rm_path in others]
        raise ValueError(
            f"--group-rm scores each group with --custom-rm-path {custom_rm_path!r}, but the samples with index "
            f"{named} name their own reward (custom_rm_path {sorted(others)}), which a group reward cannot honour: "
            "drop the samples' custom_rm_path, or drop --group-rm (or --custom-rm-path) to score each sample alone, "
            "by its own reward"
        )
    rm_function = load_function(custom_rm_path)
    try:
        rewards = await maybe_await(rm_function(args, samples, **kwargs))
    except asyncio.CancelledError:
        raise
    except BaseException as error:
        raise RewardFunctionError(
            f"group reward function {custom_rm_path!r} failed on samples with index {indices}: "
            f"{type(error).__name__}: {error}"
        ) from error
    if not isinstance(rewards, list | tuple) or len(rewards) != len(samples):
        got = f"{len(rewards)} rewards" if isinstance(rewards, list | tuple) else repr(rewards)
        raise RewardFunctionError(
            f"group reward function {custom_rm_path!r} returned {got} for {len(samples)} samples (index {indices}); "
            "with --group-rm it must return a list with one reward per sample"
        )
    return list(rewards)
