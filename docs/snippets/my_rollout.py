"""A rollout function for `--rollout-function-path`, written from scratch: every prompt group goes through the
router, each sample is scored with `--rm-type` / `--custom-rm-path`; eval runs a fixed set of probe questions."""

from __future__ import annotations

import asyncio
import functools

from transformers import AutoTokenizer

from slime.rollout.rm_hub import async_rm
from slime.utils.async_utils import run
from slime.utils.router_generate import generate_into_sample
from slime.utils.types import Sample

PROBES = [("What is 2 + 3? Reply with only the number.", "5"), ("What is 10 + 7? Reply with only the number.", "17")]


@functools.cache
def _tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


async def _generate_and_score(args, groups: list[list[Sample]], sampling_params: dict) -> list[list[Sample]]:
    tokenizer = _tokenizer(args.hf_checkpoint)

    async def one(sample: Sample) -> None:
        prompt = sample.prompt
        if isinstance(prompt, list):  # chat messages the data source did not template
            prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        sample.tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        await generate_into_sample(args, sample, dict(sampling_params))  # appends tokens, mask, log-probs
        sample.reward = await async_rm(args, sample)

    await asyncio.gather(*(one(s) for group in groups for s in group))
    return groups


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """Train: `--rollout-batch-size` groups from `data_source`. Eval: {"probes": {"rewards", "truncated", "samples"}}."""
    params = {"temperature": args.rollout_temperature, "max_new_tokens": args.rollout_max_response_len or 64}
    if not evaluation:
        return run(_generate_and_score(args, data_source.get_samples(args.rollout_batch_size), params))
    samples = [Sample(index=i, group_index=i, prompt=p, label=a) for i, (p, a) in enumerate(PROBES)]
    run(_generate_and_score(args, [[s] for s in samples], params | {"temperature": 0.0}))
    truncated = [s.status == Sample.Status.TRUNCATED for s in samples]
    return {"probes": {"rewards": [s.reward for s in samples], "truncated": truncated, "samples": samples}}
