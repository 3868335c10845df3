"""A generate function for `--custom-generate-function-path`: a multi-turn sample built with `slime.agent.multi_turn`.

The model answers; if the answer holds no number, a reminder is appended (loss mask 0: the model reads it but is
not trained to write it) and the model answers again, for at most `--max-turns` turns.
"""

from __future__ import annotations

import re

from slime.agent.multi_turn import append_observation, model_turn, start_episode
from slime.utils.types import Sample

REMINDER = "\nAnswer with a number: "


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """One sample: prompt | turn 1 | reminder | turn 2 ..., each turn sent to the router as token ids."""
    episode = start_episode(args, sample)
    while not episode.done:
        text = await model_turn(args, episode, sampling_params)
        if re.search(r"\d", text) or episode.done or not append_observation(episode, REMINDER):
            break
    return episode.sample
