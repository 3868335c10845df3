"""One token-in/token-out `/generate` request through the router, its answer appended to the sample: the turn
step shared by the default rollout and the multi-turn helpers."""

from __future__ import annotations

import argparse
from typing import Any

from slime.utils.engine_args import engine_failover_window
from slime.utils.http_utils import async_post_json
from slime.utils.types import Sample, Status


async def generate_into_sample(args: argparse.Namespace, sample: Sample, sampling_params: dict[str, Any]) -> str:
    """Send `sample.tokens` as `input_ids` to the router's `/generate` and append the answer to `sample`.

    The new tokens go in trainable, with the engine's log-probs; the engine's weight version is recorded and the
    status becomes the finish reason's (COMPLETED, TRUNCATED, ABORTED). Failed engines are retried past while
    `--use-fault-tolerance` replaces them (`engine_failover_window`).

    Returns:
        The text the engine generated.
    """
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
    output = await async_post_json(
        url,
        payload,
        timeout=getattr(args, "sglang_router_request_timeout_secs", None),
        retry_failures_for=engine_failover_window(args),
    )
    meta = output["meta_info"]
    token_logprobs = meta.get("output_token_logprobs") or []
    new_tokens = [token_id for _, token_id, _ in token_logprobs] or output.get("output_ids", [])
    log_probs = [log_prob for log_prob, _, _ in token_logprobs] or None
    sample.append_response(new_tokens, output["text"], log_probs)
    sample.weight_versions.append(str(meta.get("weight_version", "")))
    sample.status = Status.from_finish_reason(meta["finish_reason"]["type"])
    return output["text"]
