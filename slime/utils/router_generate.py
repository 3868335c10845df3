"""One token-in/token-out `/generate` request through the router (straight to an engine under routing replay), its
answer appended to the sample: the turn step shared by the default rollout and the multi-turn helpers. User
generate functions and agents call it with namespaces they build, so its fields are read with defaults; the router
and the engines come from the run context when the caller has one (the default rollout), else from `args`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from transformers import AutoConfig

from slime.utils.engine_args import engine_api_key, engine_failover_window
from slime.utils.http_utils import HTTPRequestError, async_post_json, bearer_headers
from slime.utils.lora import rollout_adapter
from slime.utils.misc import load_pretrained, load_tokenizer
from slime.utils.moe_routing import decode_routed_experts, routing_shape
from slime.utils.processing_utils import encode_image_for_rollout_engine, is_vision_language
from slime.utils.run_context import RunContext, engine_urls, router_url
from slime.utils.types import Sample, Status


def generate_payload(args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The body of a token-in/token-out `/generate` request for `sample`, as every slime generate path sends it.

    `sample.tokens` go as `input_ids`, with log-probs asked for; a sample with images
    (`multimodal_inputs["images"]`) sends them as `image_data`, and under `--lora-rank` the request names the
    adapter being trained (`lora_path`, the sample's own with several adapters).

    Raises:
        ValueError: several adapters train and the sample names none (`rollout_adapter`).
    """
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
    images = (sample.multimodal_inputs or {}).get("images")
    if images:  # SGLang's image_data: one base64 PNG per image; the prompt's placeholders may be expanded already
        payload["image_data"] = [encode_image_for_rollout_engine(image) for image in images]
    adapter = rollout_adapter(args, sample)
    if adapter is not None:  # --lora-rank: the policy is the engines' base plus the (sample's) adapter being trained
        payload["lora_path"] = adapter
    return payload


def generate_headers(args: argparse.Namespace) -> dict[str, str]:
    """The headers of a `/generate` request: the engines' key (`--sglang-api-key`) as a bearer token, if any.

    The router adds the key itself on what it forwards; the header lets the same request go to an engine directly.
    """
    return bearer_headers(engine_api_key(args))


async def generate_into_sample(
    args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any], context: RunContext | None = None
) -> str:
    """Send `sample.tokens` as `input_ids` to the router's `/generate` and append the answer to `sample`.

    The new tokens go in trainable, with the engine's log-probs; the engine's weight version is recorded and the
    status becomes the finish reason's (COMPLETED, TRUNCATED, ABORTED). Failed engines are retried past while
    `--use-fault-tolerance` replaces them (`engine_failover_window`).

    With `--use-rollout-routing-replay` the request asks for the routed experts and goes to an engine directly
    (sglang-router 0.3.2 drops `return_routed_experts` when it re-serializes a request): the same engine for a
    prompt's group, as the router's cache-aware policy would pick. The routing of the whole sequence replaces
    `sample.rollout_routed_experts`.

    A sample with images (`multimodal_inputs["images"]`) sends them as `image_data`, its `tokens` holding each
    image's placeholder (once, or expanded to its visual tokens).

    `context` is the run's (the router, the engines as fault tolerance replaces them); without one they are read
    from `args` (`sglang_router_ip`, `sglang_router_port`, `rollout_engine_urls`).

    Returns:
        The text the engine generated.
    """
    payload = generate_payload(args, sample, sampling_params)
    replay = args.use_rollout_routing_replay
    if replay:
        payload["return_routed_experts"] = True
        output = await _post_to_an_engine(args, sample, payload, lambda: engine_urls(args, context))
    else:
        output = await async_post_json(
            f"{router_url(args, context)}/generate",
            payload,
            timeout=args.sglang_router_request_timeout_secs,
            retry_failures_for=engine_failover_window(args),
            headers=generate_headers(args),
        )
    meta = output["meta_info"]
    token_logprobs = meta.get("output_token_logprobs") or []
    new_tokens = [token_id for _, token_id, _ in token_logprobs] or output.get("output_ids", [])
    log_probs = [log_prob for log_prob, _, _ in token_logprobs] or None
    generated_from, response_before = sample.response_length, sample.response
    sample.append_response(new_tokens, output["text"], log_probs)
    sample.weight_versions.append(str(meta.get("weight_version", "")))
    sample.status = Status.from_finish_reason(meta["finish_reason"]["type"])
    if replay:
        sample.rollout_routed_experts = _routed_experts(args, meta, len(sample.tokens))
    checkpoint, trust = args.hf_checkpoint, args.trust_remote_code
    image_token = _image_token_id(checkpoint, trust) if checkpoint else None
    if image_token is not None and image_token in new_tokens:
        tokenizer = load_tokenizer(checkpoint, trust)
        end_before_generated_image_token(sample, generated_from, image_token, tokenizer, response_before)
        return sample.response[len(response_before) :]
    return output["text"]


@functools.lru_cache(maxsize=4)
def _image_token_id(hf_checkpoint: str, trust_remote_code: bool) -> int | None:
    """A vision-language model's image placeholder token (`config.image_token_id`); None for a text model."""
    config = load_pretrained(AutoConfig, hf_checkpoint, trust_remote_code)
    return int(config.image_token_id) if is_vision_language(config) else None


def end_before_generated_image_token(
    sample: Sample, generated_from: int, image_token_id: int, tokenizer, response_before: str = ""
) -> None:
    """Cut the response before the first image placeholder the model generated itself (past `generated_from`).

    A vision-language model's forward reads every placeholder token as a slot for an image's features, so a
    generated one (rare in a trained model, common in a random one) has no image to fill it and cannot be trained
    on. What came before it keeps its log-probs exactly (later tokens never change earlier ones); the sample ends
    TRUNCATED, its `response` being `response_before` (the text before `generated_from`) and the kept tokens' text.
    """
    response_start = len(sample.tokens) - sample.response_length
    generated = sample.tokens[response_start + generated_from :]
    if image_token_id not in generated:
        return
    keep = generated_from + generated.index(image_token_id)
    sample.tokens = sample.tokens[: response_start + keep]
    sample.response_length = keep
    sample.loss_mask = sample.loss_mask[:keep] if sample.loss_mask is not None else None
    sample.rollout_log_probs = sample.rollout_log_probs[:keep] if sample.rollout_log_probs is not None else None
    if sample.rollout_top_p_token_offsets is not None:
        sample.rollout_top_p_token_offsets = sample.rollout_top_p_token_offsets[: keep + 1]
        sample.rollout_top_p_token_ids = sample.rollout_top_p_token_ids[: sample.rollout_top_p_token_offsets[-1]]
    if sample.rollout_routed_experts is not None:  # one row per token but the last
        sample.rollout_routed_experts = sample.rollout_routed_experts[: len(sample.tokens) - 1]
    sample.response = response_before + tokenizer.decode(sample.tokens[response_start + generated_from :])
    sample.status = Status.TRUNCATED


async def _post_to_an_engine(
    args: argparse.Namespace, sample: Sample, payload: dict[str, Any], current_urls: Callable[[], list[str]]
) -> Any:
    """POST /generate to the engine of the sample's group; while fault tolerance replaces a failed engine, ask
    again at the (new) URL `current_urls` gives."""
    give_up_at = time.monotonic() + engine_failover_window(args)
    while True:
        urls = current_urls()
        if not urls:
            raise ValueError("--use-rollout-routing-replay: no engine URLs (the rollout manager sets them)")
        url = urls[hash(sample.group_index if sample.group_index is not None else sample.index) % len(urls)]
        try:
            return await async_post_json(
                f"{url.rstrip('/')}/generate",
                payload,
                timeout=args.sglang_router_request_timeout_secs,
                headers=generate_headers(args),
            )
        except (ConnectionError, HTTPRequestError) as error:
            if isinstance(error, HTTPRequestError) and error.status < 500 or time.monotonic() >= give_up_at:
                raise
            await asyncio.sleep(1.0)


@functools.lru_cache(maxsize=4)
def _routing_shape(hf_checkpoint: str, trust_remote_code: bool) -> tuple[int, int]:
    shape = routing_shape(load_pretrained(AutoConfig, hf_checkpoint, trust_remote_code))
    if shape is None:
        raise ValueError(f"--use-rollout-routing-replay: {hf_checkpoint} is not an MoE model")
    return shape


def _routed_experts(args: argparse.Namespace, meta: dict[str, Any], num_tokens: int):
    """The engine's `[rows, layers, top_k]` routing of the sequence; an engine routes each token but the last."""
    text = meta.get("routed_experts")
    if not isinstance(text, str):
        raise ValueError(
            "--use-rollout-routing-replay: the engine's answer has no meta_info.routed_experts; launch SGLang "
            "with --enable-return-routed-experts (slime adds it) and serve an MoE model"
        )
    routed = decode_routed_experts(text, *_routing_shape(args.hf_checkpoint, args.trust_remote_code))
    if routed.shape[0] > num_tokens:
        raise ValueError(f"the engine routed {routed.shape[0]} tokens of a sequence of {num_tokens}")
    return routed
