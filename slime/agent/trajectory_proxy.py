"""The trajectory proxy: an OpenAI- and Anthropic-compatible endpoint in front of the engines that records each
agent session token in / token out, so an agent written against either client trains on exactly the tokens the
model sampled.

    proxy = TrajectoryProxy(tokenizer, api_key=engine_key)
    await proxy.start()
    session = proxy.open_session(engine_urls, sampling_params=params, max_turns=8, context_limit=4095)
    await agent(proxy.base_url(session.session_id))  # e.g. openai.AsyncOpenAI(base_url=..., api_key="any")
    # or anthropic.AsyncAnthropic(base_url=proxy.anthropic_base_url(session.session_id), api_key="any")
    sample = session_to_sample(proxy.close_session(session.session_id), sample)

Routes, under `http://127.0.0.1:<port>/sessions/<session_id>/v1` (any API key is accepted):
    POST /chat/completions   OpenAI; n=1; `stream: true` gets the finished turn as one buffered SSE stream
    POST /messages           Anthropic Messages (slime/agent/anthropic_messages.py); `stream: true` gets the
                             finished turn as Anthropic's event sequence
    POST /messages/count_tokens  the prompt's token count as a fresh conversation would render it
    GET  /models
The same routes under `http://127.0.0.1:<port>/v1` take the session id as the API key instead (`Authorization:
Bearer <id>` or `x-api-key: <id>`), for CLIs whose base URL cannot carry it (slime.agent.harness). Both wire formats
go through one turn pipeline (`_turn`): a session may even mix them.

Images: on a vision-language model (`vision=`) user and tool messages may hold image parts (`image_url` with a
`data:` URL or base64; Anthropic `image` blocks): the template's placeholder of each is expanded to the image's
visual tokens, every turn sends all the session's images so far as `image_data`, and the sample gets them
(`multimodal_inputs`, `multimodal_train_inputs`) for the trainer. A text-only model refuses image parts (400).

Each turn's prompt is the session's tokens so far (the previous prompt and the ids the engine sampled, never
re-tokenized) followed by `continuation_ids` of the messages added since (tool results, user turns). A request's
history must extend the session's: the earlier messages unchanged and the model's replies sent back as returned
(content and tool_calls); otherwise the answer is an error naming the first message that differs.

Each session is pinned to one engine (the one with the fewest open sessions) and posted to directly, so it
reuses that engine's prefix cache turn after turn. sglang-router 0.3.2 has a `manual` policy that pins an
`X-SMG-Routing-Key` header to a worker, but only if the whole router runs `--router-policy manual` (the default
cache_aware ignores the header), and it silently re-routes a key whose worker left the router.

Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}} (Anthropic's on its routes): 404
`session_not_found`; 400
`history_mismatch`, `max_turns_exceeded`, `context_length_exceeded`, `invalid_value`, `engine_rejected`;
502 `engine_error`; 503 `aborted` (an engine aborted the turn; the session takes no more turns).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from slime.agent import anthropic_messages as anthropic
from slime.agent.chat_turns import ChatTemplateError, content_parts, continuation_ids, message_images, prompt_ids
from slime.utils import openai_protocol as oai
from slime.utils.data import VisionPrompter
from slime.utils.http_utils import HTTPRequestError, async_post_json, bearer_headers
from slime.utils.processing_utils import encode_image_for_rollout_engine, load_image
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

# A long conversation is one JSON body; aiohttp's default limit is 1 MiB.
_MAX_BODY_BYTES = 256 * 2**20


class ProxyError(oai.OpenAIError):
    """A request the proxy answers with an OpenAI-shaped error; `code` names the reason (module docstring)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message, param, status, code)


@dataclass
class Turn:
    """One model turn of a session.

    Args:
        prompt_ids: The whole prompt sent to the engine.
        context_ids: The tokens added after the previous turn's output (template text and the new messages);
            empty for the first turn, whose prompt is all context.
        context_text: `context_ids` decoded.
        output_ids: The engine's `output_ids`, as returned.
        log_probs: The engine's log-prob of each output token.
        text: The engine's text (stop token or string trimmed); the reply's content and tool calls come from it.
        message: The assistant message the proxy replied with.
        finish_reason: The engine's finish reason, "stop" or "length".
        weight_version: The engine's weight version.
        engine_seconds: How long the engine took.
        matched_stop: The stop string that ended the turn, if one did.
        images: The images the turn's new messages brought (RGB PIL images), in token order.
        image_inputs: Their trainer inputs (`pixel_values`, `image_grid_thw`); None without images.
        image_data: Their engine form (base64 PNG; `encode_image_for_rollout_engine`).
    """

    prompt_ids: list[int]
    context_ids: list[int]
    context_text: str
    output_ids: list[int]
    log_probs: list[float]
    text: str
    message: dict[str, Any]
    finish_reason: str
    weight_version: str
    engine_seconds: float
    matched_stop: str | None = None
    images: list[Any] = field(default_factory=list)
    image_inputs: dict[str, Any] | None = None
    image_data: list[str] = field(default_factory=list)


@dataclass
class Session:
    """The state of one agent session.

    Args:
        session_id: Names the session in its URL.
        engine_url: The engine every turn goes to.
        sampling_params: SGLang sampling params used where a request sets none.
        max_turns: Most model turns; the next request is refused (`max_turns_exceeded`).
        context_limit: Most prompt + output tokens; `max_tokens` is lowered to fit, and a turn whose prompt
            leaves no room is refused (`context_length_exceeded`).
        turns: The model turns so far.
        stop_reason: Why the session takes no more turns: "max_turns", "context_length" or "aborted"; None while
            it does.
    """

    session_id: str
    engine_url: str
    sampling_params: dict[str, Any]
    max_turns: int | None = None
    context_limit: int | None = None
    turns: list[Turn] = field(default_factory=list)
    stop_reason: str | None = None
    # Comparable keys of the conversation so far (the last request's messages and the reply).
    history: list[tuple] = field(default_factory=list, repr=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def tokens(self) -> list[int]:
        """The conversation's tokens so far: the last prompt and its output."""
        return self.turns[-1].prompt_ids + self.turns[-1].output_ids if self.turns else []

    @property
    def image_data(self) -> list[str]:
        """The engine form of every image so far, in token order."""
        return [item for turn in self.turns for item in turn.image_data]


class TrajectoryProxy:
    """OpenAI-compatible HTTP server (in the calling process's event loop) that records sessions.

    Args:
        tokenizer: The model's HF tokenizer; its chat template renders the messages.
        api_key: The engines' API key (`--sglang-api-key`), sent as a bearer token; None when they need none.
        request_timeout: Seconds one engine request may take (None: no limit).
        model_name: The model id `GET /models` lists (default: the tokenizer's path).
        host: Interface to listen on.
        lora_path: The engines' adapter every turn generates with (`--lora-rank`); None: the base model.
        vision: The model's image side (`slime.utils.data.load_vision_prompter`) when it is a vision-language
            model: messages may then hold images. None refuses them.
    """

    def __init__(
        self,
        tokenizer,
        api_key: str | None = None,
        request_timeout: float | None = None,
        model_name: str | None = None,
        host: str = "127.0.0.1",
        lora_path: str | None = None,
        vision: VisionPrompter | None = None,
    ):
        self.tokenizer = tokenizer
        self.vision = vision
        self.lora_path = lora_path
        self.request_timeout = request_timeout
        self.model_name = model_name or str(getattr(tokenizer, "name_or_path", "") or "model")
        self.host = host
        self.url: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._headers = bearer_headers(api_key)
        self._sessions: dict[str, Session] = {}
        self._open_per_engine: dict[str, int] = {}
        self._starting: asyncio.Future | None = None
        self._runner: web.AppRunner | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on a free port of `host` (once; concurrent callers wait for the same start)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._serve())
        await self._starting

    def app(self, wire_formats: tuple[str, ...] = ("openai", "anthropic")) -> web.Application:
        """The proxy's aiohttp application serving `wire_formats` ("openai", "anthropic"), for a caller that runs it
        itself (e.g. `slime.agent.aiohttp_threaded.run_app_in_thread`); `start` runs one in the calling loop."""
        unknown = set(wire_formats) - {"openai", "anthropic"}
        if unknown:
            raise ValueError(f"unknown wire formats {sorted(unknown)}; choose from 'openai' and 'anthropic'")
        app = web.Application(middlewares=[_errors], client_max_size=_MAX_BODY_BYTES)
        for prefix in ("/sessions/{session_id}/v1", "/v1"):
            if "openai" in wire_formats:
                app.router.add_post(f"{prefix}/chat/completions", self._chat_completions)
            if "anthropic" in wire_formats:
                app.router.add_post(f"{prefix}/messages", self._messages)
                app.router.add_post(f"{prefix}/messages/count_tokens", self._count_tokens)
            app.router.add_get(f"{prefix}/models", self._models)

        async def remember_loop(_):  # sessions' locks and turns live in the loop that serves them
            self.loop = asyncio.get_running_loop()

        app.on_startup.append(remember_loop)
        return app

    async def _serve(self) -> None:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        # Port 0: the kernel picks a free port while we hold the socket, so nobody can take it first.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((self.host, 0))
        await web.SockSite(runner, sock).start()
        self._runner = runner
        self.url = f"http://{self.host}:{sock.getsockname()[1]}"
        logger.info("trajectory proxy listening on %s", self.url)

    async def stop(self) -> None:
        """Stop serving; open sessions are dropped."""
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner, self._starting, self.url = None, None, None
        self._sessions.clear()
        self._open_per_engine.clear()

    # ---- sessions -----------------------------------------------------------------------
    def open_session(
        self,
        engine_urls: list[str],
        sampling_params: dict[str, Any] | None = None,
        max_turns: int | None = None,
        context_limit: int | None = None,
        session_id: str | None = None,
    ) -> Session:
        """Open a session on the engine of `engine_urls` with the fewest open sessions (the first on a tie).

        Args:
            engine_urls: Base URLs of the engines, e.g. ["http://127.0.0.1:30000"].
            sampling_params: SGLang sampling params (`max_new_tokens`, `temperature`, ...) for the fields a
                request leaves out.
            max_turns: Most model turns (None: no limit).
            context_limit: Most prompt + output tokens of one turn (None: only the engine's limit).
            session_id: The session's id (default: a random one); it is also the API key of the `/v1` routes.

        Raises:
            ValueError: `engine_urls` is empty, or a session with `session_id` is open.
        """
        if not engine_urls:
            raise ValueError(
                "no engine URLs to open a session on (a run context gives them; outside a run, args.rollout_engine_urls)"
            )
        if session_id in self._sessions:
            raise ValueError(f"a session {session_id!r} is already open; session ids must be unique")
        engine_url = min(engine_urls, key=lambda url: self._open_per_engine.get(url, 0)).rstrip("/")
        session = Session(
            session_id or uuid.uuid4().hex, engine_url, dict(sampling_params or {}), max_turns, context_limit
        )
        self._sessions[session.session_id] = session
        self._open_per_engine[engine_url] = self._open_per_engine.get(engine_url, 0) + 1
        return session

    def base_url(self, session_id: str) -> str:
        """The OpenAI `base_url` of a session (ends in /v1)."""
        if self.url is None:
            raise RuntimeError("the trajectory proxy is not running; await proxy.start() first")
        return f"{self.url}/sessions/{session_id}/v1"

    def anthropic_base_url(self, session_id: str) -> str:
        """The Anthropic client's `base_url` of a session (the client adds /v1/messages)."""
        return self.base_url(session_id).removesuffix("/v1")

    def get_session(self, session_id: str) -> Session | None:
        """The open session `session_id`, or None."""
        return self._sessions.get(session_id)

    def close_session(self, session_id: str) -> Session:
        """Forget a session (later requests to it get `session_not_found`) and return it.

        Raises:
            KeyError: No open session has this id.
        """
        session = self._sessions.pop(session_id)
        self._open_per_engine[session.engine_url] -= 1
        return session

    # ---- routes -------------------------------------------------------------------------
    def _session(self, request: web.Request) -> Session:
        session_id = request.match_info.get("session_id") or _key_of(request)
        session = self._sessions.get(session_id)
        if session is None:
            raise ProxyError(
                404,
                f"no open session {session_id!r}: it was never opened or has ended (the agent function returned); "
                "use the base_url the agent was given while the agent runs",
                "session_not_found",
            )
        return session

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response(oai.model_list(self.model_name))

    async def _body(self, request: web.Request, session: Session) -> dict[str, Any]:
        # Images make a body larger than its tokens: a vision-language session gets the whole limit.
        limit = _MAX_BODY_BYTES if self.vision is not None else _body_limit(session, self.tokenizer)
        raw = await _read_body(request, limit)
        try:
            # Parsed off the event loop: a session's large body must not hold another session's turn.
            body = await asyncio.to_thread(json.loads, raw) if len(raw) > oai.PARSE_OFF_LOOP_BYTES else json.loads(raw)
        except (ValueError, RecursionError):
            raise ProxyError(400, "the request body is not JSON", "invalid_json") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the request body must be a JSON object", "invalid_json")
        if oai.lone_surrogate(raw, body):
            raise ProxyError(400, "the request body holds a lone UTF-16 surrogate (e.g. \\ud800)", "invalid_json")
        return body

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._body(request, session)
        messages = oai.messages_field(body)
        if body.get("n") not in (None, 1):
            raise ProxyError(400, "n must be 1: a session records one trajectory", "invalid_value", "n")
        keys = [_message_key(message, f"messages[{i}]") for i, message in enumerate(messages)]
        streaming, include_usage = oai.stream_fields(body)
        async with session.lock:  # one turn at a time: a second concurrent request must see this one's reply
            turn = await self._turn(session, messages, keys, body)
        completion = _completion(session, turn, body.get("model") or self.model_name)
        if streaming:
            return await _stream(request, completion, include_usage)
        return web.json_response(completion)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        body = await self._body(request, session)
        # Translated to the chat turn the OpenAI route takes: one pipeline records both.
        (messages, origins), chat_body = anthropic.chat_messages(body), anthropic.chat_body(body)
        streaming = oai.bool_field(body, "stream")
        try:
            keys = [_message_key(message, f"messages[{i}]") for i, message in enumerate(messages)]
            async with session.lock:
                turn = await self._turn(session, messages, keys, chat_body)
        except ProxyError as error:  # it names chat messages: name the request's
            raise anthropic.relocate(error, origins) from None
        reason, sequence = anthropic.stop_reason(turn.message, turn.finish_reason, turn.matched_stop)
        response = {
            "id": f"msg_{session.session_id}_{len(session.turns)}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model") or self.model_name,
            "content": anthropic.content_blocks(turn.message),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": len(turn.prompt_ids), "output_tokens": len(turn.output_ids)},
        }
        if not streaming:
            return web.json_response(response)
        stream = web.StreamResponse(headers=anthropic.SSE_HEADERS)
        await stream.prepare(request)
        for event in anthropic.stream_events(response):
            await stream.write(event)
        await stream.write_eof()
        return stream

    async def _count_tokens(self, request: web.Request) -> web.Response:
        session = self._session(request)
        body = await self._body(request, session)
        (messages, origins), tools = anthropic.chat_messages(body), anthropic.chat_tools(body)

        def count() -> int:
            ids, _, _ = self._with_images(prompt_ids(self.tokenizer, messages, tools), messages)
            return len(ids)

        try:
            tokens = await asyncio.to_thread(count)
        except ChatTemplateError as error:
            raise ProxyError(400, str(error), "invalid_value", "messages") from None
        except ProxyError as error:
            raise anthropic.relocate(error, origins) from None
        return web.json_response({"input_tokens": tokens})

    def _with_images(
        self, ids: list[int], messages: list[dict], first: int = 0
    ) -> tuple[list[int], list[Any], dict[str, Any] | None]:
        """(`ids` with the placeholders of the images of `messages[first:]` expanded, those images, their trainer
        inputs); `ids` as they are when there are none."""
        refs = message_images(messages, first)
        if not refs:
            return ids, [], None
        where = refs[0][0]
        if self.vision is None:
            raise ProxyError(
                400,
                f"{where} is an image, but {self.model_name} is a text-only model; send text only, or serve a "
                "vision-language model",
                "invalid_value",
                where,
            )
        try:
            images = [load_image(image, where) for where, image in refs]
            ids, inputs = self.vision.prepare(ids, images)
        except ValueError as error:
            raise ProxyError(400, str(error), "invalid_value", where) from None
        return ids, images, inputs

    def _prompt_tokens(
        self, session: Session, messages: list[dict], keys: list[tuple], start: int, tools, template_kwargs
    ) -> tuple[list[int], list[int], list[Any], dict[str, Any] | None]:
        """(the turn's prompt ids, the ids this request adds to the session's tokens, the images it adds and their
        trainer inputs); runs on a worker thread."""
        if not session.turns:
            ids, images, inputs = self._with_images(
                prompt_ids(self.tokenizer, messages, tools, template_kwargs), messages
            )
            return ids, [], images, inputs
        for i in range(start, len(messages)):
            if keys[i][0] == "assistant":
                raise ProxyError(
                    400,
                    f"messages[{i}] is an assistant message the model did not write in this session; only "
                    "the model's own replies may follow the first request (open a new session otherwise)",
                    "history_mismatch",
                    f"messages[{i}]",
                )
        context = continuation_ids(
            self.tokenizer, session.turns[-1].output_ids, messages[start:], tools, template_kwargs
        )
        context, images, inputs = self._with_images(context, messages, start)
        return session.tokens + context, context, images, inputs

    async def _turn(self, session: Session, messages: list[dict], keys: list[tuple], body: dict) -> Turn:
        if session.stop_reason is not None:
            raise _stopped(session)
        if session.max_turns is not None and len(session.turns) >= session.max_turns:
            session.stop_reason = "max_turns"
            raise _stopped(session)
        start = _extension_start(session, keys)
        tools = oai.tools_field(body)
        template_kwargs = body.get("chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise ProxyError(400, "chat_template_kwargs must be an object", "invalid_value", "chat_template_kwargs")
        if session.context_limit is not None:
            # Text that cannot fit is refused from its length, before the template and the tokenizer see it.
            chars = sum(len(content_parts(m.get("content"))[0]) for m in messages[start:])
            if chars > session.context_limit * oai.max_token_chars(self.tokenizer):
                raise ProxyError(
                    400,
                    f"the new messages hold {chars} characters, more than a context of {session.context_limit} "
                    "tokens can take; shorten them",
                    "context_length_exceeded",
                    "messages",
                )
        # Templating and tokenizing run off the event loop: one session's long turn never holds another's.
        try:
            prompt, context, images, image_inputs = await asyncio.to_thread(
                self._prompt_tokens, session, messages, keys, start, tools, template_kwargs
            )
            image_data = await asyncio.to_thread(lambda: [encode_image_for_rollout_engine(i) for i in images])
        except ChatTemplateError as error:
            raise ProxyError(400, str(error), "invalid_value", "messages") from None

        params = _sampling_params(session.sampling_params, body)
        if session.context_limit is not None:
            room = session.context_limit - len(prompt)
            if room < 1:
                session.stop_reason = "context_length"
                raise _stopped(session, f" ({len(prompt)} prompt tokens)")
            params["max_new_tokens"] = min(params.get("max_new_tokens") or room, room)

        started = time.monotonic()
        output = await self._generate(session, prompt, params, session.image_data + image_data)
        seconds = time.monotonic() - started
        meta = output["meta_info"]
        finish = meta["finish_reason"]["type"]
        if finish == "abort":
            session.stop_reason = "aborted"
            raise _stopped(session)
        triples = meta.get("output_token_logprobs") or []
        sampled = [token_id for _, token_id, _ in triples]
        output_ids = list(output.get("output_ids", sampled))
        if sampled != output_ids:
            raise ProxyError(
                502, f"engine {session.engine_url} sent log-probs of other tokens than its output_ids", "engine_error"
            )

        text = output["text"]
        matched = meta["finish_reason"].get("matched")
        message = oai.assistant_message(text, tools, id_prefix=f"call_{session.session_id[:8]}_{len(session.turns)}")
        turn = Turn(
            prompt_ids=prompt,
            context_ids=context,
            context_text=self.tokenizer.decode(context),
            output_ids=output_ids,
            log_probs=[float(log_prob) for log_prob, _, _ in triples],
            text=text,
            message=message,
            finish_reason=finish,
            weight_version=str(meta.get("weight_version", "")),
            engine_seconds=seconds,
            matched_stop=matched if isinstance(matched, str) else None,
            images=images,
            image_inputs=image_inputs,
            image_data=image_data,
        )
        session.turns.append(turn)
        session.history = keys + [_message_key(message, "the reply")]
        return turn

    async def _generate(
        self, session: Session, prompt: list[int], params: dict[str, Any], image_data: list[str]
    ) -> dict[str, Any]:
        url = f"{session.engine_url}/generate"
        payload = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        if image_data:
            payload["image_data"] = image_data
        if self.lora_path is not None:
            payload["lora_path"] = self.lora_path
        try:
            return await async_post_json(url, payload, timeout=self.request_timeout, headers=self._headers)
        except HTTPRequestError as error:
            if error.status < 500:
                raise ProxyError(
                    400,
                    f"engine {session.engine_url} refused the turn: {_engine_message(error.body)}",
                    "engine_rejected",
                ) from None
            raise ProxyError(502, f"engine {session.engine_url} failed: {error}", "engine_error") from None
        except (ConnectionError, asyncio.TimeoutError) as error:
            raise ProxyError(502, f"engine {session.engine_url} did not answer: {error!r}", "engine_error") from None


def session_to_sample(session: Session, sample: Sample) -> Sample:
    """Write a session's trajectory into `sample` (its previous response, if any, is replaced) and return it.

    tokens = the first prompt + each turn's context and output; loss_mask is 1 exactly on the sampled tokens and
    rollout_log_probs is 0.0 on the others. status comes from the last turn's finish reason: TRUNCATED when a
    budget stopped the session (`metadata["agent_stop_reason"]` says which), ABORTED when an engine aborted a
    turn, FAILED when there was no turn (tokens are then empty). A session with images gives the sample all of them
    (`multimodal_inputs["images"]`) and their trainer inputs (`multimodal_train_inputs`), in token order.
    """
    sample.tokens, sample.response, sample.response_length = [], "", 0
    sample.loss_mask = sample.rollout_log_probs = None
    sample.weight_versions = []
    sample.session_id = session.session_id
    if session.stop_reason is not None:
        sample.metadata = {**(sample.metadata or {}), "agent_stop_reason": session.stop_reason}
    if session.stop_reason == "aborted":
        sample.status = Status.ABORTED
    elif not session.turns:
        sample.status = Status.FAILED
    elif session.stop_reason is not None:
        sample.status = Status.TRUNCATED
    else:
        sample.status = Status.from_finish_reason(session.turns[-1].finish_reason)
    if not session.turns:
        return sample
    sample.tokens = list(session.turns[0].prompt_ids)
    inputs = [turn.image_inputs for turn in session.turns if turn.image_inputs]
    sample.multimodal_train_inputs = None
    if inputs:
        sample.multimodal_inputs = {
            **(sample.multimodal_inputs or {}),
            "images": [image for turn in session.turns for image in turn.images],
        }
        sample.multimodal_train_inputs = {
            key: torch.cat([each[key] for each in inputs]) for key in ("pixel_values", "image_grid_thw")
        }
    for turn in session.turns:
        if turn.context_ids:
            sample.append_response(turn.context_ids, turn.context_text, None, trainable=False)
        sample.append_response(turn.output_ids, turn.text, turn.log_probs)
        sample.weight_versions.append(turn.weight_version)
    return sample


# ---- request helpers ------------------------------------------------------------------------
def _message_key(message: dict[str, Any], where: str) -> tuple:
    """What two messages must share to be the same turn: role, text, tool calls (name, parsed arguments) and
    images (a digest of each as sent)."""
    try:
        text, images = content_parts(message.get("content"))
    except ValueError as error:
        raise ProxyError(400, f"{where}: {error}", "invalid_value", where) from None
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ProxyError(
                400, f"{where}.tool_calls must be [{{'function': {{'name', 'arguments'}}}}]", "invalid_value", where
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # not JSON: compared as written
        calls.append((function["name"], json.dumps(arguments, sort_keys=True)))
    # Clients may trim the reply's whitespace; that does not change which turn it is.
    digests = tuple(hashlib.sha1(str(image).encode()).hexdigest() for image in images)
    return message["role"], text.strip() if message["role"] == "assistant" else text, tuple(calls), digests


def _describe(key: tuple) -> str:
    role, text, calls, images = key
    shown = text if len(text) <= 80 else text[:77] + "..."
    described = f"a {role} message {shown!r}" + (f" with tool calls {[name for name, _ in calls]}" if calls else "")
    return described + (f" with {len(images)} image(s)" if images else "")


def _extension_start(session: Session, keys: list[tuple]) -> int:
    """Index of the first new message of a request, after checking that it extends the session's history."""
    for i, (have, sent) in enumerate(zip(session.history, keys)):
        if have != sent:
            raise ProxyError(
                400,
                f"messages[{i}] does not extend session {session.session_id}: the session has {_describe(have)} there, "
                f"the request {_describe(sent)}. Send the earlier messages unchanged and the model's replies as "
                "returned (content and tool_calls), then the new messages.",
                "history_mismatch",
                f"messages[{i}]",
            )
    if len(keys) < len(session.history):
        raise ProxyError(
            400,
            f"the request has {len(keys)} messages but session {session.session_id} already has {len(session.history)} "
            f"(ending with the model's reply of turn {len(session.turns)}); send the whole history, that reply "
            "included, followed by the new messages",
            "history_mismatch",
            "messages",
        )
    return len(session.history)


def _stopped(session: Session, detail: str = "") -> ProxyError:
    if session.stop_reason == "max_turns":
        return ProxyError(
            400,
            f"session {session.session_id} has used its {session.max_turns} model turns (--max-turns); end the agent "
            "loop and return its answer",
            "max_turns_exceeded",
        )
    if session.stop_reason == "context_length":
        return ProxyError(
            400,
            f"session {session.session_id} has reached the context limit of {session.context_limit} tokens{detail} "
            "(--rollout-max-context-len or the engine's context length); end the agent loop and return its answer",
            "context_length_exceeded",
            "messages",
        )
    return ProxyError(
        503,
        f"engine {session.engine_url} aborted a turn of session {session.session_id} (a weight update or the end of "
        "the rollout); the session takes no more turns and its sample goes back to the data source",
        "aborted",
    )


def _sampling_params(defaults: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """SGLang sampling params of one request: the session's defaults, overridden by the request's fields."""
    # The reply's content leaves out special tokens and the stop string, as OpenAI's does (the ids keep them).
    params = {**defaults, "skip_special_tokens": True, "no_stop_trim": False, **oai.sampling_fields(body)}
    if (top_k := oai.integer_field(body, "top_k", 1, None)) is not None:  # SGLang's extra field, Anthropic's own
        params["top_k"] = top_k
    _, seed = oai.choice_fields(body)
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def _body_limit(session: Session, tokenizer) -> int:
    """Most bytes one request of `session` may send: what its context could hold as JSON (6 bytes a character at
    worst, as \\u escapes) plus 1 MiB of structure, within `_MAX_BODY_BYTES`."""
    if session.context_limit is None:
        return _MAX_BODY_BYTES
    return min(_MAX_BODY_BYTES, session.context_limit * oai.max_token_chars(tokenizer) * 6 + 2**20)


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (read in chunks: a chunked body states no length)."""
    too_large = ProxyError(413, f"the request body exceeds this session's limit of {limit} bytes", "body_too_large")
    if (request.content_length or 0) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _engine_message(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(data.get("message", body)) if isinstance(data, dict) else body


# ---- responses ------------------------------------------------------------------------------
def _completion(session: Session, turn: Turn, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{session.session_id}-{len(session.turns)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": turn.message,
                "finish_reason": oai.finish_reason(turn.message, turn.finish_reason),
                "logprobs": None,
            }
        ],
        "usage": oai.usage(len(turn.prompt_ids), len(turn.output_ids)),
    }


async def _stream(request: web.Request, completion: dict[str, Any], include_usage: bool) -> web.StreamResponse:
    """A finished completion as server-sent chunks: the whole message, the finish reason, usage if asked."""
    head = {key: completion[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    [choice] = completion["choices"]
    delta = {"role": "assistant", "content": choice["message"]["content"]}
    if choice["message"].get("tool_calls"):
        delta["tool_calls"] = oai.tool_call_deltas(choice["message"]["tool_calls"])
    chunks = [
        head | {"choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]},
        head | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"], "logprobs": None}]},
    ]
    if include_usage:
        chunks.append(head | {"choices": [], "usage": completion["usage"]})
    response = web.StreamResponse(headers=oai.SSE_HEADERS)
    await response.prepare(request)
    for chunk in chunks:
        await response.write(oai.sse_event(chunk))
    await response.write(oai.SSE_DONE)
    await response.write_eof()
    return response


def _key_of(request: web.Request) -> str:
    """The API key a request carries (`Authorization: Bearer <key>` or `x-api-key`); on the `/v1` routes it is the
    session id."""
    bearer = request.headers.get("Authorization", "")
    if bearer[:7].lower() == "bearer ":
        return bearer[7:].strip()
    return request.headers.get("x-api-key", "").strip()


def _error_response(error: oai.OpenAIError, request: web.Request) -> web.Response:
    if request.path.endswith(("/v1/messages", "/v1/messages/count_tokens")):
        body = anthropic.error_envelope(error.message, error.status, error.code)
    else:
        body = oai.error_envelope(error.message, error.status, error.param, error.code)
    # OpenAI clients retry 5xx answers; a retried turn after an abort would only be aborted again.
    headers = {"x-should-retry": "false"} if error.status == 503 else None
    return web.json_response(body, status=error.status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except oai.OpenAIError as error:
        return _error_response(error, request)
    except web.HTTPException as error:  # no such route, or the wrong method
        if error.status < 400:
            raise
        message = (
            f"{request.method} {request.path} is not served here; a session serves POST "
            "/sessions/<session_id>/v1/chat/completions, POST /sessions/<session_id>/v1/messages and GET "
            "/sessions/<session_id>/v1/models (or the same under /v1 with the session id as the API key)"
        )
        return _error_response(
            ProxyError(error.status, message, "not_found" if error.status == 404 else "invalid_method"), request
        )
    except Exception as error:
        logger.exception("trajectory proxy: %s %s failed", request.method, request.path)
        return _error_response(ProxyError(500, f"the trajectory proxy failed: {error!r}", "internal_error"), request)
