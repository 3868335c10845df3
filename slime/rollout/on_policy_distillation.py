"""Upstream slime's on-policy-distillation plugin functions, on top of `slime.rollout.opd`:

    --use-opd --rm-url http://TEACHER_HOST:PORT/generate \\
    --custom-rm-path slime.rollout.on_policy_distillation.reward_func \\
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards

`reward_func` asks the teacher engine to score each sample (the same request `--opd-teacher-url` sends) and keeps
its whole answer as the sample's reward; `post_process_rewards` turns those answers into `Sample.teacher_log_probs`
and every reward into 0.0 (pure distillation: the teacher term is the whole learning signal).
`--use-opd --opd-teacher-url URL` does the same without the two hooks.
"""

from __future__ import annotations

import argparse

from slime.rollout.opd import request_teacher, teacher_generate_url, teacher_log_probs_from_response
from slime.utils.types import Sample


async def reward_func(args: argparse.Namespace, sample: Sample, **kwargs) -> dict:
    """The teacher's `/generate` answer for `sample`'s tokens (`args.rm_url`, its base URL or `/generate`).

    Returns:
        SGLang's answer dict; `meta_info.input_token_logprobs` holds the teacher's log-prob of every token.

    Raises:
        ValueError: `--rm-url` is not an http(s) URL.
        TeacherError: The teacher is unreachable or refused the request.
    """
    url = teacher_generate_url(args.rm_url, flag="--rm-url")
    return await request_teacher(args, sample, url, flag="--rm-url")


def post_process_rewards(args: argparse.Namespace, samples: list[Sample], **kwargs) -> tuple[list[float], list[float]]:
    """Store each sample's teacher log-probs (from the answer `reward_func` left as its reward) in
    `sample.teacher_log_probs`, and give every sample the scalar reward 0.0.

    A sample the engine aborted or failed (never scored) gets zeros: its tokens are not trained on.

    Returns:
        (raw rewards, rewards), both all 0.0, one per sample.

    Raises:
        TeacherError: An answer lacks the log-probs of the sample's response tokens.
    """
    url = args.rm_url or "--rm-url"
    for sample in samples:
        if sample.unfinished:
            sample.teacher_log_probs = [0.0] * sample.response_length
        else:
            sample.teacher_log_probs = teacher_log_probs_from_response(sample.reward, sample, url)
    rewards = [0.0] * len(samples)
    return rewards, list(rewards)
