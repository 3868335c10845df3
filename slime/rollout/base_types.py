"""Return types of rollout functions (`--rollout-function-path`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.utils.types import Sample


@dataclass
class RolloutFnTrainOutput:
    """A training rollout: `samples` is a list of groups, one group per prompt."""

    samples: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RolloutFnEvalOutput:
    """An eval rollout: `data[name]` holds "rewards", "truncated" and "samples" of one eval set."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, float] = field(default_factory=dict)


def call_rollout_fn(fn, *args, evaluation: bool, **kwargs) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Call a rollout function `fn(*args, evaluation=evaluation, **kwargs)` and return its output as a
    `RolloutFnEvalOutput` (eval) or `RolloutFnTrainOutput` (train): a function that returns the bare eval dict or
    list of groups (the older contract) gets it wrapped, with no metrics."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(output, RolloutFnTrainOutput | RolloutFnEvalOutput):
        return output
    return RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
