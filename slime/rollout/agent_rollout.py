"""Agent rollouts (`--agent-function-path`): each sample is one session of the user's agent against the trajectory
proxy, an OpenAI-compatible endpoint that records what the model sampled token for token.

The agent is `async agent(base_url, sample, sampling_params) -> str | None`: it talks to `base_url` with any
OpenAI client (`openai.AsyncOpenAI(base_url=base_url, api_key="any")`, the openai-agents SDK, ...), runs its
tools, and returns its final answer (kept in `sample.metadata["agent_answer"]`) or None. The session becomes the
sample: the model's tokens trained on (loss mask 1), tool / user / template tokens not (mask 0). A session gets
`--max-turns` model turns and stays within the context limit; requests past either are refused and
the sample is TRUNCATED. An agent that raises gives a FAILED sample, never trained on, and the rollout goes on.

The rollout is also driven with namespaces holding only the agent's fields (tests, examples), so those are read
with defaults.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from slime.agent.chat_turns import prompt_ids
from slime.agent.multi_turn import load_tokenizer, load_vision
from slime.agent.trajectory_proxy import TrajectoryProxy, session_to_sample
from slime.utils.engine_args import context_limit as default_context_limit
from slime.utils.engine_args import engine_api_key
from slime.utils.lora import rollout_adapter
from slime.utils.misc import load_function
from slime.utils.run_context import RunContext, engine_urls
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

Agent = Callable[[str, Sample, dict[str, Any]], Awaitable[str | None]]

_proxy: TrajectoryProxy | None = None


@functools.cache
def load_agent(path: str) -> Agent:
    """The agent function at dotted `path`.

    Raises:
        TypeError: It is not an `async def` function.
    """
    agent = load_function(path)
    if not inspect.iscoroutinefunction(agent):
        raise TypeError(
            f"--agent-function-path {path} must name an async function "
            "`async def agent(base_url, sample, sampling_params) -> str | None`"
        )
    return agent


async def get_proxy(args) -> TrajectoryProxy:
    """This process's trajectory proxy, started on first use in the running event loop."""
    global _proxy
    if _proxy is None or _proxy.loop not in (None, asyncio.get_running_loop()):
        # The server lives in one loop; a new loop (only tests make several) needs its own.
        _proxy = TrajectoryProxy(
            load_tokenizer(args.hf_checkpoint, args.trust_remote_code),
            api_key=engine_api_key(args),
            request_timeout=args.sglang_router_request_timeout_secs,
            lora_path=rollout_adapter(args),
            vision=load_vision(args.hf_checkpoint, args.trust_remote_code),  # image parts, for a VLM
        )
    await _proxy.start()
    return _proxy


async def generate(
    args,
    sample: Sample,
    sampling_params: dict[str, Any],
    context_limit: int | None = None,
    run_context: RunContext | None = None,
) -> Sample:
    """Run the `--agent-function-path` agent on `sample` through the trajectory proxy and return the sample.

    Args:
        args: Parsed arguments: `agent_function_path`, `max_turns`, `hf_checkpoint`, `sglang_api_key`,
            `rollout_max_context_len` (and `rollout_engine_urls` without a run context).
        sample: The prompt sample; its response fields are replaced by the session's.
        sampling_params: SGLang sampling params for the turns whose request does not set them; the agent gets a copy.
        context_limit: Most prompt + response tokens of a turn; None means `--rollout-max-context-len`, never more
            than the engine holds (the default rollout passes its own, `--eval-max-context-len` in eval).
        run_context: The run's context, whose engines the sessions use; None reads them from `args`.

    Returns:
        The sample, with `status` COMPLETED / TRUNCATED from the session, ABORTED when an engine aborted a turn,
        FAILED (and `remove_sample`) when the agent raised or never called the model.
    """
    agent = load_agent(args.agent_function_path)
    proxy = await get_proxy(args)
    session = proxy.open_session(
        engine_urls(args, run_context),
        sampling_params=sampling_params,
        max_turns=args.max_turns,
        context_limit=context_limit if context_limit is not None else default_context_limit(args),
    )
    started = time.monotonic()
    error: Exception | None = None
    try:
        answer = await agent(proxy.base_url(session.session_id), sample, dict(sampling_params))
        if answer is not None and not isinstance(answer, str):
            raise TypeError(f"the agent returned {type(answer).__name__}, not the final answer as str or None")
    except Exception as e:  # the agent's own failure: this sample fails, the rollout goes on
        answer, error = None, e
    finally:
        proxy.close_session(session.session_id)

    session_to_sample(session, sample)
    engine_seconds = sum(turn.engine_seconds for turn in session.turns)
    sample.non_generation_time += max(0.0, time.monotonic() - started - engine_seconds)
    if answer is not None:
        sample.metadata = {**(sample.metadata or {}), "agent_answer": answer}
    # An agent that stops on the proxy's refusal (turn or context budget, abort) keeps the status that explains it.
    if error is not None and session.stop_reason is None:
        logger.warning(
            "sample %s: agent %s raised %r after %d turns; the sample is FAILED",
            sample.index,
            args.agent_function_path,
            error,
            len(session.turns),
            exc_info=error,
        )
        sample.status = Status.FAILED
        sample.metadata = {**(sample.metadata or {}), "agent_error": repr(error)}
    elif not session.turns and sample.status == Status.FAILED:
        reason = session.stop_reason or "the agent returned without calling the model"
        logger.warning(
            "sample %s: the agent session has no model turn (%s); the sample is FAILED", sample.index, reason
        )
    if sample.status == Status.FAILED:
        sample.remove_sample = True  # a broken trajectory is never trained on
    if not session.turns:  # the trainer (or a retry of an aborted sample) still needs the prompt's tokens
        sample.tokens = _prompt_tokens(load_tokenizer(args.hf_checkpoint, args.trust_remote_code), sample.prompt)
    return sample


def _prompt_tokens(tokenizer, prompt: str | list[dict[str, Any]]) -> list[int]:
    if isinstance(prompt, list):
        return prompt_ids(tokenizer, prompt)
    return tokenizer.encode(prompt, add_special_tokens=False)
