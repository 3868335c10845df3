"""Multi-turn geo3k on a vision-language model: answer, get a zoomed picture back when wrong, answer again.

    --custom-generate-function-path rollout.generate   (with examples/geo3k_vlm_multi_turn on PYTHONPATH)

Each sample is one token sequence: the prompt with its picture, the model's turns (trained on), and the
environment's answers (`env_geo3k.step`: a verdict and a zoomed picture; loss mask 0, log-prob 0). The zoomed
picture's placeholder is expanded to its visual tokens and the picture joins the sample's images, so the next turn's
request carries both pictures and the trainer sees both, in token order. `--max-turns` caps the model turns;
`--rm-type math` grades the last `\\boxed{}` of the response.
"""

from __future__ import annotations

from typing import Any

from env_geo3k import step

from slime.agent.multi_turn import append_messages, model_turn, start_episode
from slime.utils.types import Sample


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Custom generate function: model turns and the environment's zoomed pictures until a right answer,
    `--max-turns` or a full context."""
    episode = start_episode(args, sample)
    images = (sample.multimodal_inputs or {}).get("images")
    if not images:
        raise ValueError(
            f'sample {sample.index} has no picture; give the data\'s images with --multimodal-keys \'{{"image": "images"}}\''
        )
    picture = images[0]
    while not episode.done:
        text = await model_turn(args, episode, sampling_params)
        message = step(picture, sample.label, text)
        if message is None or episode.done or not append_messages(episode, [message]):
            break
    return sample
