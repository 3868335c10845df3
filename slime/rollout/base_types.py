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
