"""OpenAI-compatible routes on the CPU engine: /v1/chat/completions, /v1/completions, /v1/models.

Each request is translated into the same body /generate takes and parsed by `parse_generate_request`,
so validation, context-length checks and stop handling are the native ones. SGLang's extra fields
(`top_k`, `min_p`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `no_stop_trim`),
which sglang-router forwards, are honoured as SGLang's OpenAI server does. Tool calls in the
Hermes / Qwen `<tool_call>` format become `tool_calls` (see `slime.utils.tool_calls`). A LoRA adapter
is chosen with SGLang's extra field `lora_path` or a `model` of the form `<base>:<adapter name>`.
On a vision-language model, chat content may hold `image_url` parts (a `data:` URL or bare base64; web URLs and
file paths are refused, so no client can make the engine read a file on its host): each becomes an `{"type": "image"}` part for the chat template, which writes the
model's image placeholder, and the images go to the engine as /generate's `image_data`.

`stream: true` answers server-sent events token by token, fed from the engine's decode loop through
a `TokenWatch`: a choice's text goes out as soon as it can no longer change (an incomplete UTF-8
character, or a tail that may grow into a stop string or a `<tool_call>`, waits for the next token),
and the concatenated deltas equal the non-streamed text. A client that disconnects aborts its requests.
Log-probs (`logprobs` / `top_logprobs` for chat, `logprobs: k` for completions, k <= 20) follow the
engine's convention: `log_softmax(raw_logits / temperature)` over the full vocabulary.
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; an error after the
stream started comes as an SSE event `{"error": ...}`, which the openai client raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from slime.backends.cpu_engine.engine import MAX_TOP_LOGPROBS, CpuEngine, TokenWatch
from slime.backends.cpu_engine.protocol import (
    GenerationRequest,
    RequestError,
    build_generate_response,
    check_text_fits,
    parse_generate_request,
    parse_sampling_params,
)
from slime.utils import openai_protocol as oai
from slime.utils.openai_protocol import OpenAIError
from slime.utils.processing_utils import load_image
from slime.utils.tool_calls import TOOL_CALL_START

logger = logging.getLogger(__name__)

RunRequests = Callable[[CpuEngine, list[GenerationRequest], TokenWatch | None], Awaitable[list[GenerationRequest]]]
ReadBody = Callable[[web.Request], Awaitable[dict[str, Any]]]

# Fields that would change the answer but are not implemented, with the value that means "off".
_UNSUPPORTED = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "continue_final_message": (False,),
    "return_hidden_states": (False,),
}
# SGLang's own request fields (sglang-router forwards them, filling in defaults) -> `sampling_params` names.
_SGLANG_FIELDS = {
    "top_k": "top_k",
    "min_p": "min_p",
    "min_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "repetition_penalty": "repetition_penalty",
    "regex": "regex",
    "ebnf": "ebnf",
}


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    # `code` is the HTTP status, as SGLang's OpenAI server sends it.
    return oai.error_envelope(message, status, param, None if status >= 500 else status)


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    """OpenAI's error body (see `slime.utils.openai_protocol.error_envelope`)."""
    return web.json_response(_error_body(message, status, param), status=status)


def _sampling(body: dict, engine: CpuEngine) -> dict[str, Any]:
    """OpenAI sampling fields -> SGLang `sampling_params` (without the per-choice seed)."""
    for name, neutral in _UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise OpenAIError(f"'{name}' is not supported by the CPU engine; omit it", name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise OpenAIError("'best_of' is not supported by the CPU engine; omit it or set it equal to 'n'", "best_of")
    params = {"temperature": 1.0, "top_p": 1.0, **oai.sampling_fields(body, engine.context_length)}
    for name, native in _SGLANG_FIELDS.items():
        if body.get(name) is not None:
            try:  # checked here so the error names the field as the client spelled it
                parse_sampling_params({native: body[name]}, engine.vocab_size)
            except RequestError as error:
                raise OpenAIError(f"'{name}': {error.message}", name) from None
            params[native] = body[name]
    return params


def _adapters(body: dict, engine: CpuEngine, prompts: int) -> list[str | None]:
    """The LoRA adapter of each prompt: SGLang's `lora_path` (one name, or one per prompt), else the `<base>:<adapter>`
    form of `model` on an engine serving adapters; None is the base model."""
    value = body.get("lora_path")
    model = body.get("model")
    if value is None and engine.lora is not None and isinstance(model, str) and ":" in model:
        value = model.rpartition(":")[2]
    if value is None or isinstance(value, str):
        return [value] * prompts
    if isinstance(value, list) and len(value) == prompts and all(v is None or isinstance(v, str) for v in value):
        return value
    raise OpenAIError(
        f"'lora_path' must be an adapter name, null, or a list of those with one per prompt ({prompts}); got {value!r}",
        "lora_path",
    )


def _build_requests(
    engine: CpuEngine,
    prompts: list[list[int]],
    params: dict,
    n: int,
    seed: int | None,
    logprobs: bool,
    adapters: list[str | None],
    images: list[Any] | None = None,
) -> list[GenerationRequest]:
    """n requests per prompt, through the native parser; choice i of a seeded request uses `seed + i`.

    Without `max_tokens` a choice may run to the end of the context, as OpenAI's default. `adapters` holds
    each prompt's LoRA adapter (see `_adapters`); `images` the images of a single prompt (chat).
    """
    base = uuid.uuid4().hex
    sampling = [
        {
            **({"max_new_tokens": max(engine.context_length - len(ids), 0)} if "max_new_tokens" not in params else {}),
            **params,
            **({} if seed is None else {"sampling_seed": seed + i}),
        }
        for ids in prompts
        for i in range(n)
    ]
    native = {
        "input_ids": [ids for ids in prompts for _ in range(n)],
        "sampling_params": sampling,
        "return_logprob": logprobs,
        "return_text_in_logprobs": logprobs,
        "rid": [f"{base}-{k}" for k in range(len(prompts) * n)],
        "lora_path": [adapter for adapter in adapters for _ in range(n)],
    }
    if images:
        native["image_data"] = [images] * (len(prompts) * n)
    requests, _ = parse_generate_request(
        native, engine.tokenizer, engine.vocab_size, engine.context_length, engine.vision
    )
    return requests


def _text(request: GenerationRequest, engine: CpuEngine) -> str:
    """The output text with the matched stop token / stop string cut off, as /generate returns it."""
    return build_generate_response(request, engine.tokenizer)["text"]


def _finish_reason(request: GenerationRequest) -> str:
    kind = (request.finish_reason or {}).get("type", "abort")
    return kind if kind in ("stop", "length") else "abort"


def _usage(prompts: list[list[int]], finished: list[GenerationRequest]) -> dict[str, int]:
    # As OpenAI counts: each prompt once, however many choices it has.
    return oai.usage(sum(len(p) for p in prompts), sum(len(r.output_ids) for r in finished))


# (token id, its log-prob, its top log-probs [(token id, log-prob), ...]) for one generated token.
TokenLogProb = tuple[int, float, list[tuple[int, float]]]


def _entries(request: GenerationRequest, tops: list[list[tuple[int, float]]] | None) -> list[TokenLogProb]:
    tops = tops or [[] for _ in request.output_ids]
    return list(zip(request.output_ids, request.output_logprobs, tops))


def _top_logprobs(body: dict, logprobs: bool) -> int:
    top = oai.integer_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if top and not logprobs:
        raise OpenAIError("'top_logprobs' needs 'logprobs': true; send both or neither", "top_logprobs")
    return top


def _chat_logprobs(engine: CpuEngine, entries: list[TokenLogProb]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = engine.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries]}


def _completion_logprobs(engine: CpuEngine, entries: list[TokenLogProb], top: int, offset: int) -> dict[str, Any]:
    """The legacy shape; `offset` is where the first token's text starts in the choice's text."""
    tokens = [engine.tokenizer.decode([t]) for t, _, _ in entries]
    offsets = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    tops = None
    if top:
        tops = []
        for _, _, pairs in entries:
            by_text: dict[str, float] = {}
            for token_id, logprob in pairs:  # most likely first: it keeps a text several tokens decode to
                by_text.setdefault(engine.tokenizer.decode([token_id]), logprob)
            tops.append(by_text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


# ----- streaming -----------------------------------------------------------------------------


def _settled_text(text: str, markers: list[str], strip_space: bool) -> str:
    """The part of a partial output that later tokens can neither change nor cut off.

    Held back: a trailing incomplete UTF-8 character (decoded as U+FFFD), everything from the first
    `marker` on, a tail that may still grow into a marker, and with `strip_space` trailing whitespace.
    """
    text = text.rstrip("\ufffd")
    for marker in markers:
        if marker in text:
            text = text[: text.index(marker)]
    hold = max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
    text = text[: len(text) - hold]
    return text.rstrip() if strip_space else text


@dataclass
class _Choice:
    """One streamed choice: its tokens so far, the text already sent, the log-probs not sent yet."""

    index: int
    request: GenerationRequest
    ids: list[int] = field(default_factory=list)
    sent: str = ""
    pending: list[TokenLogProb] = field(default_factory=list)


@dataclass
class _Update:
    """New text of one choice and the log-probs of the tokens behind it; `final` once the choice ended."""

    choice: _Choice
    text: str
    entries: list[TokenLogProb]
    final: bool


@dataclass
class _Stream:
    """Requests in flight whose tokens arrive on `queue` (see `_start_stream`)."""

    engine: CpuEngine
    choices: dict[GenerationRequest, _Choice]
    queue: asyncio.Queue
    markers: list[str]
    strip_space: bool
    final_text: Callable[[GenerationRequest], str]
    done: set[GenerationRequest] = field(default_factory=set)

    async def updates(self) -> AsyncIterator[_Update]:
        """Each choice's new settled text as its tokens arrive, then its final text once it ends.

        Raises:
            RequestError: 500 when the engine failed a request.
        """
        tokenizer = self.engine.tokenizer
        while len(self.done) < len(self.choices):
            request, entry, last = await self.queue.get()
            choice = self.choices[request]
            if entry is None:  # the request ended
                self.done.add(request)
                if request.error:
                    raise RequestError(f"generation failed: {request.error}", status=request.error_status)
                final = self.final_text(request)
                if not final.startswith(choice.sent):
                    logger.warning("request %s: streamed %r, but its final text is %r", request.rid, choice.sent, final)
                rest = final[len(choice.sent) :] if final.startswith(choice.sent) else ""
                update = _Update(choice, rest, choice.pending, final=True)
                choice.sent, choice.pending = choice.sent + rest, []
                yield update
                continue
            choice.ids.append(entry[0])
            choice.pending.append(entry)
            if last:  # the end event follows with the text as /generate trims it
                continue
            decoded = tokenizer.decode(choice.ids, skip_special_tokens=request.params.skip_special_tokens)
            text = _settled_text(decoded, request.params.stop + self.markers, self.strip_space)
            if len(text) > len(choice.sent) and text.startswith(choice.sent):
                update = _Update(choice, text[len(choice.sent) :], choice.pending, final=False)
                choice.sent, choice.pending = text, []
                yield update

    def abort_unfinished(self) -> None:
        for request in self.choices:
            if request not in self.done:
                self.engine.abort(request.rid)


def _start_stream(
    engine: CpuEngine,
    requests: list[GenerationRequest],
    top_logprobs: int,
    final_text: Callable[[GenerationRequest], str],
    markers: tuple[str, ...] = (),
    strip_space: bool = False,
) -> _Stream:
    """Submit `requests` with a watch that queues every token; raises RequestError before anything is sent."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def post(item: tuple) -> None:  # on the engine's worker thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def on_token(request: GenerationRequest, top: list[tuple[int, float]], last: bool) -> None:
        post((request, (request.output_ids[-1], request.output_logprobs[-1], top), last))

    for request in requests:
        request.on_finish = lambda r: post((r, None, True))
    choices = {r: _Choice(i, r) for i, r in enumerate(requests)}
    stream = _Stream(engine, choices, queue, list(markers), strip_space, final_text)
    engine.submit(requests, TokenWatch(on_token, top_logprobs))
    return stream


async def _send_events(request: web.Request, chunks: AsyncIterator[dict]) -> web.StreamResponse:
    """Write `chunks` as server-sent events as they come, then `data: [DONE]`."""
    response = web.StreamResponse(headers=oai.SSE_HEADERS)
    await response.prepare(request)
    try:
        try:
            async for chunk in chunks:
                await response.write(oai.sse_event(chunk))
        except RequestError as error:
            await response.write(oai.sse_event(_error_body(error.message, error.status)))
        await response.write(oai.SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:  # the client left; the caller aborts what still generates
        pass
    return response


# ----- chat ----------------------------------------------------------------------------------


# (where, reference) of each image of a chat, in order: `messages[0].content[1]`, its data URL or base64.
ImageRefs = list[tuple[str, str]]


def _image_url(part: dict, where: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise OpenAIError(f"{where}.image_url must be {{'url': 'data:image/png;base64,...'}}", where)
    return url


def _content(content: list, where: str, takes_images: bool, refs: ImageRefs) -> str | list[dict[str, str]]:
    """Content parts as the chat template takes them: joined text, or (with images) text and image parts in order,
    each image's reference appended to `refs`."""
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url" and takes_images:
            refs.append((f"{where}.content[{j}]", _image_url(part, f"{where}.content[{j}]")))
            parts.append({"type": "image"})
        elif kind == "image_url":
            raise OpenAIError(
                f"{where}.content[{j}]: this engine serves a text-only model, which takes no images", where
            )
        else:
            allowed = "{'type': 'text', 'text': ...}" + (" or {'type': 'image_url', ...}" if takes_images else "")
            raise OpenAIError(f"{where}.content parts must each be {allowed}", where)
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _messages(body: dict, takes_images: bool = False) -> tuple[list[dict[str, Any]], ImageRefs]:
    """`messages` as the chat template takes them (content as text, or text and image parts; tool-call arguments
    as mappings), and the references of their images in order."""
    out, refs = [], []
    for i, message in enumerate(oai.messages_field(body)):
        where = f"messages[{i}]"
        content = message.get("content")
        if isinstance(content, list):
            content = _content(content, where, takes_images, refs)
        elif content is not None and not isinstance(content, str):
            raise OpenAIError(f"{where}.content must be a string, a list of text parts or null", where)
        message = {**message, "content": content or ""}
        for call in message.get("tool_calls") or []:
            # Chat templates render arguments as a mapping; OpenAI clients send them as a JSON string.
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    raise OpenAIError(f"{where}.tool_calls arguments must be a JSON object string", where) from None
        out.append(message)
    return out, refs


def _tools(body: dict) -> list[dict] | None:
    """The tools to render and parse calls of; none with `tool_choice: "none"`."""
    tools = oai.tools_field(body)
    return None if body.get("tool_choice") == "none" else tools


def _chat_images(refs: ImageRefs) -> list[Any]:
    """The decoded images of a chat; an unreadable one is an OpenAIError naming its content part."""
    try:
        return [load_image(ref, where, allow_path=False) for where, ref in refs]  # client input: never a file
    except ValueError as error:
        raise OpenAIError(str(error), str(error).partition(":")[0]) from None


def _chat_prompt(engine: CpuEngine, messages: list[dict], tools: list[dict] | None) -> list[int]:
    try:
        text = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as error:  # jinja errors: a role order or field the template does not accept
        raise OpenAIError(f"the model's chat template rejected the messages: {error}", "messages") from None
    check_text_fits(text, engine.tokenizer, engine.context_length, "the templated messages")
    # The template writes any BOS itself.
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _chat_choice(
    index: int, request: GenerationRequest, engine: CpuEngine, tools: list | None, entries: list[TokenLogProb] | None
) -> dict:
    message = oai.assistant_message(_text(request, engine), tools)
    logprobs = None if entries is None else _chat_logprobs(engine, entries)
    finish = oai.finish_reason(message, _finish_reason(request))
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


# ----- routes --------------------------------------------------------------------------------


def add_routes(
    app: web.Application, engine: CpuEngine, run_requests: RunRequests, read_body: ReadBody, max_queued: int
) -> None:
    """Register the /v1 routes on `app`.

    `run_requests` and `read_body` are the server's own helpers; beyond `max_queued` waiting requests
    a call answers 503 with Retry-After, as /generate does.

    Streaming with `tools`: content streams up to the first `<tool_call>`; the parsed `tool_calls` come in
    the last chunk, once the text is complete. (The non-streamed content is stripped of surrounding
    whitespace when calls are found; the streamed one may keep whitespace sent before the call.)
    """
    model_name = engine.model_path

    def openai_errors(handler):
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except (RequestError, OpenAIError) as error:
                response = error_response(error.message, error.status, getattr(error, "param", None))
                if error.status == 503:
                    response.headers["Retry-After"] = "1"
                return response

        return wrapped

    def check_queue(count: int) -> None:
        waiting = engine.load()["num_waiting_reqs"]
        if waiting + count > max_queued:
            raise RequestError(
                f"the engine's queue is full ({waiting} requests waiting, --max-queued-requests {max_queued}); "
                "retry later",
                status=503,
            )

    async def run(requests: list[GenerationRequest], top_logprobs: int) -> list[list[TokenLogProb]]:
        """Generate to the end; returns every request's token log-prob records."""
        check_queue(len(requests))
        tops: dict[GenerationRequest, list] = {r: [] for r in requests}
        watch = TokenWatch(lambda r, top, last: tops[r].append(top), top_logprobs) if top_logprobs else None
        finished = await run_requests(engine, requests, watch)
        failed = next((r for r in finished if r.error), None)
        if failed is not None:
            raise RequestError(f"generation failed: {failed.error}", status=failed.error_status)
        return [_entries(r, tops[r]) for r in finished]

    async def stream(
        request: web.Request, requests: list[GenerationRequest], top_logprobs: int, chunks, **options
    ) -> web.StreamResponse:
        """Stream `chunks(updates)` for `requests`; whatever still generates when the stream ends is aborted."""
        check_queue(len(requests))
        started = _start_stream(engine, requests, top_logprobs, **options)
        try:
            return await _send_events(request, chunks(started.updates()))
        finally:  # also on a disconnect, which cancels this handler
            started.abort_unfinished()

    @openai_errors
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        messages, image_refs = _messages(body, engine.vision is not None)
        tools = _tools(body)
        params = _sampling(body, engine)
        n, seed = oai.choice_fields(body)
        streaming, include_usage = oai.stream_fields(body)
        logprobs = oai.bool_field(body, "logprobs")
        top_logprobs = _top_logprobs(body, logprobs)
        # Templating and tokenizing take a while on a long conversation: off the event loop.
        prompt = await asyncio.to_thread(_chat_prompt, engine, messages, tools)
        adapters = _adapters(body, engine, 1)
        if image_refs:  # decoding and processing images takes a while too
            images = await asyncio.to_thread(_chat_images, image_refs)
            requests = await asyncio.to_thread(
                _build_requests, engine, [prompt], params, n, seed, logprobs, adapters, images
            )
        else:
            requests = _build_requests(engine, [prompt], params, n, seed, logprobs, adapters)
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or model_name,
        }
        if not streaming:
            entries = await run(requests, top_logprobs)
            # Usage counts the prompt as the model sees it: image placeholders expanded.
            choices = [
                _chat_choice(i, r, engine, tools, e if logprobs else None)
                for i, (r, e) in enumerate(zip(requests, entries))
            ]
            return web.json_response({**head, "choices": choices, "usage": _usage([requests[0].input_ids], requests)})

        head["object"] = "chat.completion.chunk"

        async def chunks(updates: AsyncIterator[_Update]) -> AsyncIterator[dict]:
            for i in range(len(requests)):
                start = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield {**head, "choices": [start]}
            async for update in updates:
                delta: dict[str, Any] = {"content": update.text} if update.text else {}
                choice = {"index": update.choice.index, "delta": delta, "finish_reason": None}
                choice["logprobs"] = _chat_logprobs(engine, update.entries) if logprobs else None
                if update.final:
                    request = update.choice.request
                    message = oai.assistant_message(_text(request, engine), tools)
                    if message.get("tool_calls"):
                        delta["tool_calls"] = oai.tool_call_deltas(message["tool_calls"])
                    choice["finish_reason"] = oai.finish_reason(message, _finish_reason(request))
                yield {**head, "choices": [choice]}
            if include_usage:
                yield {**head, "choices": [], "usage": _usage([requests[0].input_ids], requests)}

        def final_text(request: GenerationRequest) -> str:
            return oai.assistant_message(_text(request, engine), tools)["content"] or ""

        markers = [TOOL_CALL_START] if tools else []
        return await stream(
            request, requests, top_logprobs, chunks, final_text=final_text, markers=markers, strip_space=bool(tools)
        )

    @openai_errors
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        n, seed = oai.choice_fields(body)
        # The work a call implies is bounded before anything is tokenized or built: a 30 KB body of 6000 token
        # lists with n=128 would otherwise build 768k requests on the event loop, for a 503 no retry can fix.
        asked = _prompt_count(body) * n
        if asked > max_queued:
            raise OpenAIError(
                f"this call asks for {asked} generations ({asked // n} prompts x n={n}); the engine takes at most "
                f"{max_queued} per call (--max-queued-requests): send fewer prompts or a smaller n",
                "prompt",
            )
        # Tokenizing long prompts takes a while: off the event loop, so /health and the other requests go on.
        prompts = await asyncio.to_thread(_completion_prompts, body, engine)
        params = _sampling(body, engine)
        streaming, include_usage = oai.stream_fields(body)
        logprobs = oai.integer_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        top_logprobs = logprobs or 0
        adapters = _adapters(body, engine, len(prompts))
        requests = _build_requests(engine, prompts, params, n, seed, logprobs is not None, adapters)
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or model_name,
        }
        if not streaming:
            entries = await run(requests, top_logprobs)
            choices = [
                {
                    "index": i,
                    "text": _text(r, engine),
                    "finish_reason": _finish_reason(r),
                    "logprobs": None if logprobs is None else _completion_logprobs(engine, e, top_logprobs, 0),
                }
                for i, (r, e) in enumerate(zip(requests, entries))
            ]
            return web.json_response({**head, "choices": choices, "usage": _usage(prompts, requests)})

        async def chunks(updates: AsyncIterator[_Update]) -> AsyncIterator[dict]:
            offsets = [0] * len(requests)
            async for update in updates:
                index, request = update.choice.index, update.choice.request
                choice = {"index": index, "text": update.text, "logprobs": None, "finish_reason": None}
                if logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(engine, update.entries, top_logprobs, offsets[index])
                    offsets[index] += sum(len(t) for t in choice["logprobs"]["tokens"])
                if update.final:
                    choice["finish_reason"] = _finish_reason(request)
                yield {**head, "choices": [choice]}
            if include_usage:
                yield {**head, "choices": [], "usage": _usage(prompts, requests)}

        return await stream(request, requests, top_logprobs, chunks, final_text=lambda r: _text(r, engine))

    async def models(request: web.Request) -> web.Response:
        return web.json_response(oai.model_list(model_name, root=model_name, max_model_len=engine.context_length))

    async def not_found(request: web.Request) -> web.Response:
        routes = "/v1/chat/completions, /v1/completions, /v1/models"
        return error_response(f"no route {request.method} {request.path} on this engine; it serves {routes}", 404)

    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/v1/{tail:(?!loads$).*}", not_found)


def _prompt_count(body: dict) -> int:
    """How many prompts `prompt` holds, read without tokenizing anything (1 for what is not a list)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or all(oai.is_integer(t) for t in prompt):
        return 1
    return len(prompt)


def _completion_prompts(body: dict, engine: CpuEngine) -> list[list[int]]:
    """`prompt` as a string, a list of strings, a list of token ids or a list of such lists."""
    prompt = body.get("prompt")
    bad = OpenAIError("'prompt' must be a non-empty string, token id list, or a list of either", "prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad
    if all(oai.is_integer(t) for t in prompt):
        prompt = [prompt]
    out = []
    for i, item in enumerate(prompt):
        if isinstance(item, str) and item:
            check_text_fits(item, engine.tokenizer, engine.context_length, f"prompt[{i}]")
            out.append(engine.tokenizer.encode(item))
        elif isinstance(item, list) and item and all(oai.is_integer(t) and 0 <= t < engine.vocab_size for t in item):
            out.append(item)
        else:
            raise bad
    return out
