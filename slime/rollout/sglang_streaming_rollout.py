"""Upstream slime's streaming generate function: the default rollout's per-sample generate, over SGLang's streamed
`/generate` (`"stream": true`, server-sent events) instead of one JSON answer.

    --custom-generate-function-path slime.rollout.sglang_streaming_rollout.generate_streaming

Every event is written onto the sample as it arrives (SGLang's events are cumulative: each carries the whole text
and `output_token_logprobs` so far), so when a rollout abort or a dropped connection cuts the stream the sample
already holds what was generated: it comes back ABORTED with that partial response, which `--partial-rollout`
continues later. The rollout loop around it (concurrency, aborts, the data source) is the default one.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

import aiohttp

from slime.rollout.sglang_rollout import get_state, prepare_generate
from slime.utils.http_utils import HTTPRequestError
from slime.utils.router_generate import generate_headers, generate_payload
from slime.utils.run_context import RunContext, router_url
from slime.utils.types import Sample, Status

__all__ = ["generate_streaming", "stream_into_sample"]

logger = logging.getLogger(__name__)


def _events(buffer: bytearray) -> list[dict[str, Any]]:
    """Take the complete `data: {...}` lines out of `buffer` (in place) and return their JSON payloads."""
    events = []
    while (end := buffer.find(b"\n")) >= 0:
        line = bytes(buffer[:end]).strip()
        del buffer[: end + 1]
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            events.append(json.loads(data))
        except json.JSONDecodeError:
            logger.warning("skipping a streamed event that is not JSON: %r", data[:120])
    return events


async def stream_into_sample(
    args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any], context: RunContext | None = None
) -> str:
    """Stream `sample.tokens` through the router's `/generate` and keep the sample current with every event.

    The request is the default rollout's (`generate_payload`: images, the LoRA adapter; the engines' key as a bearer
    header) with `"stream": true`. The new tokens go in trainable, with the engine's log-probs. At the end the engine's weight version is recorded
    and the status becomes the finish reason's; a stream that ends without one (cut by an abort or a dropped
    connection) leaves the sample ABORTED with the tokens received so far.

    Returns:
        The text generated in this call.

    Raises:
        HTTPRequestError: The router answered with an error status.
        ConnectionError: The router could not be reached.
    """
    url = f"{router_url(args, context)}/generate"
    payload = generate_payload(args, sample, sampling_params) | {"stream": True}
    base = (list(sample.tokens), sample.response, sample.response_length, sample.loss_mask, sample.rollout_log_probs)
    meta: dict[str, Any] = {}
    text = ""
    timeout = aiohttp.ClientTimeout(total=args.sglang_router_request_timeout_secs)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            response = await session.post(url, json=payload, headers=generate_headers(args))
        except aiohttp.ClientConnectionError as error:
            raise ConnectionError(f"POST {url} (streamed generate) failed: {error!r}") from error
        async with response:
            if response.status >= 400:
                body = (await response.read()).decode("utf-8", errors="replace")
                raise HTTPRequestError("POST", url, response.status, body)
            buffer = bytearray()
            try:
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    for event in _events(buffer):
                        meta = event.get("meta_info") or {}
                        text = event.get("text", text)
                        token_logprobs = meta.get("output_token_logprobs") or []
                        tokens, response_text, length, mask, log_probs = base
                        sample.tokens, sample.response, sample.response_length = list(tokens), response_text, length
                        sample.loss_mask = None if mask is None else list(mask)
                        sample.rollout_log_probs = None if log_probs is None else list(log_probs)
                        sample.append_response(
                            [t for _, t, _ in token_logprobs], text, [p for p, _, _ in token_logprobs]
                        )
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as error:
                logger.warning(
                    "sample %s: the generate stream was cut (%r); keeping its partial response", sample.index, error
                )
    finish_reason = meta.get("finish_reason")
    if isinstance(finish_reason, dict):
        sample.weight_versions.append(str(meta.get("weight_version", "")))
        sample.status = Status.from_finish_reason(finish_reason.get("type"))
    else:
        sample.status = Status.ABORTED
    return text


async def generate_streaming(args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Generate (or, for a partial rollout, continue) one response through the router, streamed.

    Same meaning as the default generate (`slime.rollout.sglang_rollout.generate`), whose request preparation it
    shares (`prepare_generate`: the prompt tokenized on the first call, images expanded, a continuation asking only
    for the tokens its earlier part left); the answer arrives as a stream (`stream_into_sample`).

    Raises:
        ValueError: The prompt leaves no room for a response in the context.
    """
    params = prepare_generate(args, sample, sampling_params)
    if params is not None:
        await stream_into_sample(args, sample, params, get_state(args).context)
    return sample
