"""`--custom-rm-path reward.reward_func`: grade the calculator agent's final answer (the slime side of the example)."""

from __future__ import annotations

from argparse import Namespace
from typing import Any

from slime.rollout.rm_hub.last_number import compute_last_number_reward
from slime.utils.types import Sample


async def reward_func(args: Namespace, sample: Sample, **kwargs: Any) -> float:
    """1.0 when the last number of the answer the agent returned (`metadata["agent_answer"]`) equals the label.

    The response itself is the whole session (tool results and reminders included), so it is not what is
    graded; an agent that returned no answer scores 0.
    """
    return compute_last_number_reward(sample.metadata.get("agent_answer") or "", sample.label)
