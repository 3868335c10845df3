"""A dynamic-sampling filter (`--dynamic-sampling-filter-path`) and a buffer filter (`--buffer-filter-path`)."""

from __future__ import annotations

from slime.rollout.filter_hub import DynamicFilterOutput
from slime.utils.types import Sample


def drop_truncated_groups(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Keep a prompt group only if none of its responses ran out of tokens."""
    truncated = sum(s.status == Sample.Status.TRUNCATED for s in samples)
    if truncated:
        return DynamicFilterOutput(keep=False, reason=f"{truncated} of {len(samples)} responses truncated")
    return DynamicFilterOutput(keep=True)


def newest_first(args, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """Take up to `num_samples` groups from the buffer, the most recently put back first."""
    taken = buffer[len(buffer) - min(num_samples, len(buffer)) :]
    del buffer[len(buffer) - len(taken) :]
    return taken[::-1]
