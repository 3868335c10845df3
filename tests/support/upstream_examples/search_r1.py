"""search-r1's shape: answer, see a search result (context, not trained on), answer again."""

import asyncio

from slime.observability import logging_utils
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

SEARCH_RESULT = "\n<information>Doc 1: two plus two is four.</information>\n"


async def search(query: str) -> str:
    await asyncio.sleep(0.01)  # a retriever takes time
    return SEARCH_RESULT


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = state.tokenizer.apply_chat_template(sample.prompt, tokenize=False, add_generation_prompt=True)
    sample.tokens = state.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for turn in range(2):
        payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        logprobs = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(
            args,
            tokens=[token for _, token, _ in logprobs],
            log_probs=[logprob for logprob, _, _ in logprobs],
            trainable=True,
            meta_info=output["meta_info"],
            text=output["text"],
        )
        if turn == 0:
            result = await search(output["text"])
            result_ids = state.tokenizer(result, add_special_tokens=False)["input_ids"]
            sample.append_response_tokens(args, tokens=result_ids, trainable=False, text=result)
    sample.metadata["searches"] = 1
    logging_utils.log(args, {"search_r1/last_searches": 1})  # joins the rollout's logged row
    return sample


async def reward(args, sample: Sample) -> float:
    exact_match = float(str(sample.label) in sample.response)
    # A tiny random model never answers right; the index's parity keeps the group's advantages non-zero.
    return exact_match + float(sample.index % 2)
