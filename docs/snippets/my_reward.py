"""Reward functions for `--custom-rm-path`: one sample at a time, or (with `--group-rm`) a whole prompt group."""

from __future__ import annotations

import re

from slime.utils.types import Sample


def _last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


async def exact_number(args, sample: Sample, **kwargs) -> float:
    """1.0 when the last number in the response equals the label, else 0.0."""
    return float(_last_number(sample.response) == str(sample.label).strip())


async def shortest_correct_bonus(args, samples: list[Sample], **kwargs) -> list[float]:
    """`--group-rm`: 1.0 per correct response, 1.5 for the shortest correct one of the group."""
    rewards = [float(_last_number(s.response) == str(s.label).strip()) for s in samples]
    correct = [i for i, reward in enumerate(rewards) if reward == 1.0]
    if correct:
        rewards[min(correct, key=lambda i: samples[i].response_length)] += 0.5
    return rewards
