"""Reward functions: built-in rules picked by `--rm-type`, or a user function from `--custom-rm-path`.

Built-in types: math, deepscaler, dapo, f1, gpqa, last_number (rule based); boxed_f1 and boxed_gpqa (grade only the
last `\\boxed{...}` of the response; math, deepscaler and dapo find the boxed answer themselves);
remote_rm (HTTP server at `--rm-url`); random. A sample's `metadata["rm_type"]` overrides `--rm-type`,
so one dataset can mix reward types.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from slime.utils.misc import load_function, maybe_await
from slime.utils.types import Sample

from .dapo import compute_dapo_reward
from .deepscaler import get_deepscaler_rule_based_reward
from .f1 import f1_score
from .gpqa import compute_gpqa_reward
from .last_number import compute_last_number_reward
from .math_rm import compute_math_reward
from .math_utils import extract_boxed_answer
from .remote_rm import remote_rm

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
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    return RULE_BASED_REWARDS[base_type](response, sample.label, metadata)


async def async_rm(args, sample: Sample, **kwargs) -> float | dict:
    """Reward of one sample.

    Args:
        args: Reads `custom_rm_path` and `rm_type` (plus `rm_url` etc. for remote_rm).
        sample: The sample with its `response` and `label`.
        **kwargs: Passed on to a custom reward function.

    Returns:
        A float, or a dict of rewards (dapo, or a custom function) to pick from with `--reward-key`.

    Raises:
        ValueError: no reward configured, or an unknown reward type.
        RewardFunctionError: the reward function raised; the original error is its `__cause__`.
    """
    custom_rm_path = getattr(args, "custom_rm_path", None)
    if custom_rm_path:
        rm_function = load_function(custom_rm_path)
        rm_name = f"custom reward function {custom_rm_path!r}"
    else:
        metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
        rm_type = (metadata.get("rm_type") or getattr(args, "rm_type", None) or "").strip()
        if not rm_type:
            raise ValueError(f"no reward function: set --rm-type ({_valid_types_text()}) or --custom-rm-path")
        base_type, boxed = resolve_rm_type(rm_type)
        rm_name = f"reward type {rm_type!r}"
    try:
        if custom_rm_path:
            return await maybe_await(rm_function(args, sample, **kwargs))
        return await _builtin_reward(args, sample, base_type, boxed)
    except Exception as error:
        raise RewardFunctionError(
            f"{rm_name} failed on sample index {sample.index}: {type(error).__name__}: {error}"
        ) from error


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
    """
    custom_rm_path = getattr(args, "custom_rm_path", None)
    if not (getattr(args, "group_rm", False) and custom_rm_path):
        return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))

    rm_function = load_function(custom_rm_path)
    indices = [sample.index for sample in samples]
    try:
        rewards = await maybe_await(rm_function(args, samples, **kwargs))
    except Exception as error:
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
