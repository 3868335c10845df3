"""What both adapters share: the session API over one trajectory proxy, and `flatten_content`.

    adapter = AnthropicAdapter(tokenizer=tokenizer, sglang_url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}")
    handle = run_app_in_thread(adapter.app)                    # slime.agent.aiohttp_threaded
    adapter.open_session(sid, sampling_defaults=sampling_params, max_context_tokens=args.rollout_max_context_len)
    ...                                                        # the agent calls handle.url with api_key=sid
    samples = await adapter.finish_session(sid, base_sample=sample, reward=reward)

Differences from upstream's adapters: a session is one linear trajectory (a request whose history does not extend
it is refused with `history_mismatch`, where upstream forks a new branch), so `finish_session` returns one sample; a
turn past `max_turns_per_sid` is refused with 400 `max_turns_exceeded` (upstream: 429); tool calls are parsed in the
Hermes / Qwen `<tool_call>` format whenever a request lists tools, whatever `tool_parser` names (None included), and
no reasoning parser is applied.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from slime.agent.trajectory_proxy import Session, TrajectoryProxy, session_to_sample
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

# SGLang's names for the `<tool_call>{json}</tool_call>` format the proxy parses (slime/utils/tool_calls.py).
TOOL_PARSERS = ("hermes", "qwen", "qwen25")


def flatten_content(content: Any) -> str:
    """The text of a message `content` in either wire format: a string as is; a list of parts (OpenAI text /
    input_text / output_text parts, Anthropic text and tool_result blocks, nested `content`) joined by newlines,
    images as "[image omitted]"; None as ""; anything else through `str`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return str(content)
    parts = []
    for part in content:
        if not isinstance(part, dict):
            parts.append(str(part))
        elif part.get("type") in ("text", "input_text", "output_text"):
            parts.append(part.get("text") or "")
        elif part.get("type") in ("image", "image_url", "input_image"):
            parts.append("[image omitted]")
        elif "content" in part:  # tool_result and other wrappers
            parts.append(flatten_content(part["content"]))
        elif "text" in part:
            parts.append(str(part["text"] or ""))
    return "\n".join(part for part in parts if part)


class BaseAdapter:
    """An aiohttp app (`self.app`) serving one wire format in front of an engine or router, recording a session
    per id.

    Args:
        tokenizer: The served model's HF tokenizer (its chat template renders the messages).
        sglang_url: Where turns are generated: the router (`http://{args.sglang_router_ip}:{args.sglang_router_port}`)
            or one engine.
        tool_parser: SGLang's tool-call parser name; one of `TOOL_PARSERS` or None. They all mean the same here:
            the proxy parses `<tool_call>{json}</tool_call>` calls whenever a request lists tools, so None is
            Hermes too (another parser's format is refused rather than misparsed).
        reasoning_parser: Must be None: reasoning stays in the reply's text.
        max_turns_per_sid: Most model turns of one session (None: no limit).
        api_key: The engines' API key (`--sglang-api-key`).
        request_timeout: Seconds one engine request may take.

    Raises:
        ValueError: A parser this proxy cannot apply.
    """

    wire_formats: tuple[str, ...] = ("openai", "anthropic")

    def __init__(
        self,
        *,
        tokenizer,
        sglang_url: str,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        max_turns_per_sid: int | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
    ):
        if tool_parser not in (None, *TOOL_PARSERS):
            raise ValueError(
                f"tool_parser={tool_parser!r}: the trajectory proxy parses tool calls written as "
                f"<tool_call>{{json}}</tool_call> only (SGLang's {', '.join(TOOL_PARSERS)}); pass one of those or None"
            )
        if reasoning_parser is not None:
            raise ValueError(
                f"reasoning_parser={reasoning_parser!r}: the trajectory proxy does not split reasoning out of the "
                "model's reply (it stays in the text); pass None"
            )
        self.tokenizer = tokenizer
        self.sglang_url = sglang_url.rstrip("/")
        self.max_turns_per_sid = max_turns_per_sid
        self.proxy = TrajectoryProxy(tokenizer, api_key=api_key, request_timeout=request_timeout)
        self.app = self.proxy.app(self.wire_formats)

    def open_session(self, sid: str, *, sampling_defaults: dict | None = None, max_context_tokens: int = 0) -> None:
        """Open session `sid` (the agent sends it as its API key).

        Args:
            sampling_defaults: SGLang sampling params for the fields a request leaves out.
            max_context_tokens: Most prompt + output tokens (0: only the engine's limit).

        Raises:
            ValueError: `sid` is already open.
        """
        self.proxy.open_session(
            [self.sglang_url],
            sampling_params=sampling_defaults,
            max_turns=self.max_turns_per_sid,
            context_limit=max_context_tokens or None,
            session_id=sid,
        )

    async def _close(self, sid: str, wait_timeout: float) -> Session | None:
        """Wait up to `wait_timeout` s for `sid`'s turn in flight, then close it; None when it is not open."""
        session = self.proxy.get_session(sid)
        if session is None:
            return None

        async def turn_done() -> None:
            async with session.lock:
                pass

        loop = self.proxy.loop
        try:
            if loop is None or loop is asyncio.get_running_loop():
                await asyncio.wait_for(turn_done(), wait_timeout)
            else:  # the app runs in its own thread (run_app_in_thread): the lock belongs to that loop
                waiting = asyncio.run_coroutine_threadsafe(asyncio.wait_for(turn_done(), wait_timeout), loop)
                await asyncio.wrap_future(waiting)
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11; two before
            logger.warning("session %s still had a turn in flight after %s s; closing it anyway", sid, wait_timeout)
        return self.proxy.close_session(sid) if self.proxy.get_session(sid) is not None else None

    async def finish_session(
        self,
        sid: str,
        *,
        base_sample: Sample | None = None,
        reward: float = 0.0,
        extra_metadata: dict | None = None,
        wait_timeout: float = 5.0,
    ) -> list[Sample]:
        """Close `sid` (after its turn in flight, if any) and return its trajectory as samples.

        The trajectory is written into `base_sample` (`session_to_sample`) with `reward` and `extra_metadata` added.
        Returns [] when `sid` is not open (calling it twice is safe) or when no `base_sample` is given (a plain
        close).
        """
        session = await self._close(sid, wait_timeout)
        if session is None or base_sample is None:
            return []
        sample = session_to_sample(session, base_sample)
        sample.reward = reward
        if extra_metadata:
            sample.metadata = {**(sample.metadata or {}), **extra_metadata}
        return [sample]

    async def drop_session(self, sid: str, *, wait_timeout: float = 5.0) -> None:
        """Close `sid` and forget its trajectory (no-op when it is not open)."""
        await self._close(sid, wait_timeout)
