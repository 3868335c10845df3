"""On-policy distillation, rollout side: the teacher's log-prob of every response token (`Sample.teacher_log_probs`).

With `--use-opd --opd-type sglang --opd-teacher-url URL` the default rollout (and so any
`--custom-generate-function-path`) sends every finished training sample to the teacher engine, an SGLang
server or slime's CPU engine (`python -m slime.backends.cpu_engine`), as a scoring request on SGLang's native
`/generate`: the sample's `input_ids`, `max_new_tokens: 0`, `return_logprob: true`, `logprob_start_len: 0`.
The last `response_length` entries of the answer's `meta_info.input_token_logprobs` are the teacher's
log-probs of the response tokens. The trainer then subtracts `--opd-kl-coef` x (student - teacher) log-prob
from the advantages (`slime.algorithms.opd`).

Without `--opd-teacher-url`, user code sets `Sample.teacher_log_probs` (upstream's recipe: a
`--custom-rm-path` that asks the teacher and a `--custom-reward-post-process-path` that stores them; both are in
`slime.rollout.on_policy_distillation`, on top of this module). Without
`--rm-type` and `--custom-rm-path` every sample's reward is 0: pure distillation, the teacher term is the
whole learning signal.
"""

from __future__ import annotations

import argparse
import asyncio
from urllib.parse import urlsplit

from slime.utils.http_utils import HTTPRequestError, async_post_json
from slime.utils.types import Sample, Status


class TeacherError(RuntimeError):
    """The teacher engine could not be reached, refused a sample, or answered without usable log-probs."""


def teacher_generate_url(url: str, flag: str = "--opd-teacher-url") -> str:
    """The teacher's `/generate` URL, from its base URL (`http://host:port`) or that URL itself; `flag` named it."""
    parts = urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{flag} {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:30000")
    return url if parts.path.rstrip("/").endswith("/generate") else url.rstrip("/") + "/generate"


def teacher_request(args: argparse.Namespace, sample: Sample) -> dict:
    """The scoring request for `sample`: prefill only, log-probs of every input token at the rollout temperature
    (the temperature the trainer takes the student's log-probs at)."""
    return {
        "input_ids": list(sample.tokens),
        "sampling_params": {"temperature": args.rollout_temperature, "max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def teacher_log_probs_from_response(response: dict, sample: Sample, url: str) -> list[float]:
    """The teacher's log-probs of `sample`'s response tokens, from its `/generate` answer.

    Raises:
        TeacherError: The answer has no `meta_info.input_token_logprobs`, too few of them, a missing value, or
            other token ids than the sample's (the teacher tokenizes differently or truncated the input).
    """
    meta_info = response.get("meta_info") if isinstance(response, dict) else None
    entries = meta_info.get("input_token_logprobs") if isinstance(meta_info, dict) else None
    length = sample.response_length
    if not isinstance(entries, list) or len(entries) < length + 1:
        found = len(entries) if isinstance(entries, list) else "no"
        raise TeacherError(
            f"the OPD teacher at {url} answered sample {sample.index} with {found} input_token_logprobs for its "
            f"{len(sample.tokens)} tokens; the teacher must be an SGLang-compatible engine that returns "
            "meta_info.input_token_logprobs for logprob_start_len 0"
        )
    tail = entries[len(entries) - length :]
    response_ids = sample.tokens[len(sample.tokens) - length :]
    log_probs = []
    for position, (entry, token_id) in enumerate(zip(tail, response_ids, strict=True)):
        if not isinstance(entry, list | tuple) or len(entry) < 2 or entry[0] is None or entry[1] != token_id:
            raise TeacherError(
                f"the OPD teacher at {url} answered {entry!r} for response token {position} of sample "
                f"{sample.index}, which is token {token_id}; the teacher must share the student's tokenizer"
            )
        log_probs.append(float(entry[0]))
    return log_probs


async def request_teacher(args: argparse.Namespace, sample: Sample, url: str, flag: str = "--opd-teacher-url") -> dict:
    """The teacher's raw `/generate` answer to `teacher_request(args, sample)` at `url`.

    Connection failures and 502/503 answers are retried (3 times, backing off); a request waits at most
    `--sglang-router-request-timeout-secs` when that is set.

    Args:
        flag: The flag that named `url`, for the error message.

    Raises:
        TeacherError: The teacher is unreachable, or refused the request (the message has its answer).
    """
    try:
        return await async_post_json(
            url, teacher_request(args, sample), timeout=args.sglang_router_request_timeout_secs
        )
    except HTTPRequestError as error:
        raise TeacherError(
            f"the OPD teacher at {url} refused sample {sample.index} ({len(sample.tokens)} tokens) with HTTP "
            f"{error.status}: {error.body[:500]}"
        ) from error
    except (ConnectionError, asyncio.TimeoutError) as error:
        raise TeacherError(
            f"cannot reach the OPD teacher at {url} ({error!r}); start the teacher engine or fix {flag}"
        ) from error


async def fetch_teacher_log_probs(args: argparse.Namespace, sample: Sample) -> list[float]:
    """The teacher's log-prob of each of `sample`'s response tokens, from the engine at `--opd-teacher-url`
    (see `request_teacher`).

    Raises:
        TeacherError: The teacher is unreachable, refused the request, or answered without the log-probs.
    """
    if sample.response_length == 0:
        return []
    url = teacher_generate_url(args.opd_teacher_url)
    return teacher_log_probs_from_response(await request_teacher(args, sample, url), sample, url)


def _no_reward_configured(args: argparse.Namespace, sample: Sample) -> bool:
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    return not (args.custom_rm_path or args.rm_type or metadata.get("rm_type"))


async def score_with_teacher(args: argparse.Namespace, samples: list[Sample], evaluation: bool = False) -> None:
    """`--use-opd`: set `teacher_log_probs` of every training sample the engine did not abort (in place), when
    `--opd-teacher-url` is set; give reward 0 to samples no reward function scores (pure distillation).

    An aborted sample goes back to the data source and is scored once it finishes; eval samples are not sent to
    the teacher (nothing trains on them).
    """
    if not args.use_opd:
        return
    finished = [s for s in samples if s.status != Status.ABORTED]
    for s in finished:
        if s.reward is None and s.status != Status.FAILED and _no_reward_configured(args, s):
            s.reward = 0.0  # a failed sample keeps no reward: it stays unfinished, not trained on
    if evaluation or not args.opd_teacher_url:
        return
    scored = await asyncio.gather(*(fetch_teacher_log_probs(args, s) for s in finished))
    for s, log_probs in zip(finished, scored, strict=True):
        s.teacher_log_probs = log_probs
