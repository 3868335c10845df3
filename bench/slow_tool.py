"""An agentic workload whose tool call takes real time, for `bench/async_vs_sync.py --tool-latency S`.

    --custom-generate-function-path slow_tool.generate --max-turns 2   (bench/ on PYTHONPATH)

Each sample: the model answers, a checker tool looks at the answer and takes `SLIME_BENCH_TOOL_LATENCY` seconds
to reply (as a sandboxed test run or a web API would; the wait uses no CPU), and the model answers again after
the checker's verdict. The verdict is a user turn (loss mask 0); both model turns are trained on. The reward is
the run's `--rm-type` on the whole response, so its last answer counts.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from slime.agent.multi_turn import append_messages, model_turn, start_episode
from slime.rollout.rm_hub.last_number import compute_last_number_reward
from slime.utils.types import Sample

LATENCY_ENV = "SLIME_BENCH_TOOL_LATENCY"


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One answer, the checker's slow verdict, one more answer (`--max-turns 2`)."""
    latency = float(os.environ.get(LATENCY_ENV, "0"))
    episode = start_episode(args, sample)
    text = await model_turn(args, episode, sampling_params)
    if episode.done:
        return sample
    await asyncio.sleep(latency)
    right = compute_last_number_reward(text, sample.label) > 0
    verdict = "The checker says: correct." if right else "The checker says: wrong. Answer again with one number."
    if append_messages(episode, [{"role": "user", "content": verdict}]) and not episode.done:
        await model_turn(args, episode, sampling_params)
    return sample
