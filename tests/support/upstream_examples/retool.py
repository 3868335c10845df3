"""retool's shape: the model's code runs in an interpreter whose output joins the context; DAPO's scorer grades."""

from slime.rollout.rm_hub.math_dapo_utils import compute_score
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

INTERPRETER_OUTPUT = "\n<interpreter>4</interpreter>\n"


async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = state.tokenizer.apply_chat_template(sample.prompt, tokenize=False, add_generation_prompt=True)
    sample.tokens = state.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for turn in range(2):
        output = await post(
            url, {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
        )
        logprobs = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(
            args,
            tokens=[token for _, token, _ in logprobs],
            log_probs=[logprob for logprob, _, _ in logprobs],
            meta_info=output["meta_info"],
            text=output["text"],
        )
        if turn == 0:
            ids = state.tokenizer(INTERPRETER_OUTPUT, add_special_tokens=False)["input_ids"]
            sample.append_response_tokens(args, tokens=ids, trainable=False, text=INTERPRETER_OUTPUT)
    sample.metadata["tool_call_count"] = 1
    return sample


async def reward_func(args, sample: Sample, **kwargs) -> dict:
    result = compute_score(sample.response, sample.label, strict_box_verify=True)
    if result["pred"] is None:
        result["pred"] = ""
    return result
