"""Reward from an HTTP reward-model server (`--rm-type remote_rm --rm-url ...`)."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from slime.utils.types import Sample

if TYPE_CHECKING:
    import aiohttp  # imported where a request is made: the reward workers, which import this module, never do


class RemoteRewardError(RuntimeError):
    """The reward server answered with an error status (kept in `status`) or could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


async def _post_once(session: aiohttp.ClientSession, url: str, payload: dict):
    async with session.post(url, json=payload) as response:
        if response.status >= 400:
            body = (await response.text())[:500]
            raise RemoteRewardError(f"reward server {url} returned HTTP {response.status}: {body}", response.status)
        text = await response.text()
        try:
            return json.loads(text)
        except ValueError as error:
            # Not retried: the server is up but speaks another protocol.
            raise RemoteRewardError(f"reward server {url} sent non-JSON: {text[:200]!r}", response.status) from error


async def remote_rm(args, sample: Sample) -> float | dict:
    """POST the sample to `args.rm_url` and return the reward it sends back.

    The request body is `{"prompt", "response", "label", "metadata"}`. The server may answer with a
    bare number, or with a JSON object: its `"reward"` field is used when present, otherwise the whole
    object is returned (pick a field with `--reward-key`). A request gets `args.rm_request_timeout_secs`.
    Timeouts, server errors (5xx) and connection errors are retried `args.rm_max_retries` times, waiting
    `args.rm_retry_delay` seconds doubled after each try; client errors (4xx) fail at once.

    Args:
        args: Needs `rm_url`.
        sample: The sample to score.

    Returns:
        The reward as a float, or the server's JSON object.

    Raises:
        RemoteRewardError: the last try failed; the message names the URL and the number of attempts.
    """
    url = args.rm_url
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url (e.g. http://127.0.0.1:8000/reward)")
    max_retries, delay, request_timeout = args.rm_max_retries, args.rm_retry_delay, args.rm_request_timeout_secs
    if request_timeout <= 0 or max_retries < 0 or delay < 0:
        raise ValueError(
            f"--rm-request-timeout-secs must be > 0 and --rm-max-retries, --rm-retry-delay >= 0; got "
            f"{request_timeout}, {max_retries}, {delay}"
        )
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label, "metadata": sample.metadata}
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=request_timeout)) as session:
        for attempt in range(max_retries + 1):
            try:
                result = await _post_once(session, url, payload)
                break
            except (RemoteRewardError, aiohttp.ClientError, asyncio.TimeoutError) as error:
                status = getattr(error, "status", None)
                if attempt == max_retries or (status is not None and status < 500):
                    attempts = f"(after {attempt + 1} attempt(s))"
                    if isinstance(error, asyncio.TimeoutError):
                        message = (
                            f"reward server {url} did not answer within {request_timeout} s {attempts}; "
                            "raise --rm-request-timeout-secs if it is just slow"
                        )
                    elif status is None:
                        message = f"cannot reach reward server {url}: {error} {attempts}"
                    else:
                        message = f"{error} {attempts}"
                    raise RemoteRewardError(message, status) from error
                await asyncio.sleep(delay * 2**attempt)

    if isinstance(result, dict) and "reward" in result:
        result = result["reward"]
    if isinstance(result, bool) or not isinstance(result, int | float | dict):
        raise RemoteRewardError(f"reward server {url} answered {result!r}; expected a number or a JSON object")
    return result if isinstance(result, dict) else float(result)
