"""multi_agent's shape: each prompt sample becomes several agents' samples, scored together; a problem no agent
solves returns no samples at all."""

import asyncio
from copy import deepcopy

from slime.rollout.rm_hub import batched_async_rm
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

NUM_AGENTS = 2


async def run_agent(args, sample: Sample, sampling_params, role: str) -> Sample:
    state = GenerateState(args)
    agent_sample = deepcopy(sample)
    messages = [{"role": "system", "content": f"You are the {role}."}, *sample.prompt]
    text = state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    agent_sample.tokens = state.tokenizer(text, add_special_tokens=False)["input_ids"]
    output = await post(
        f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate",
        {"input_ids": agent_sample.tokens, "sampling_params": sampling_params, "return_logprob": True},
    )
    logprobs = output["meta_info"]["output_token_logprobs"]
    agent_sample.append_response_tokens(
        args,
        tokens=[token for _, token, _ in logprobs],
        log_probs=[logprob for logprob, _, _ in logprobs],
        meta_info=output["meta_info"],
        text=output["text"],
    )
    agent_sample.metadata["role"] = role
    return agent_sample


async def generate_with_multi_agents(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    if sample.metadata.get("unsolvable"):
        return []  # every agent failed: nothing to train on
    roles = ["solver", "rewriter"][:NUM_AGENTS]
    samples = list(await asyncio.gather(*(run_agent(args, sample, sampling_params, role) for role in roles)))
    for agent_sample, value in zip(samples, await batched_async_rm(args, samples), strict=True):
        agent_sample.reward = value * (1.2 if value > 0 else 0.8)
    for agent_sample in samples:
        agent_sample.rollout_id = sample.index  # one agent run: its samples count once in the loss
    return samples


async def reward(args, sample: Sample) -> float:
    return float(sample.metadata["role"] == "solver")
