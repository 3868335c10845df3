"""OpenAI-compatible routes on the CPU engine: /v1/chat/completions, /v1/completions, /v1/models.

Each request is translated into the same body /generate takes and parsed by `parse_generate_request`,
so validation, context-length checks and stop handling are the native ones. Tool calls in the
Hermes / Qwen `<tool_call>` format become `tool_calls` (see `slime.utils.tool_calls`).

`stream: true` answers server-sent events, sent once generation has finished (the engine reports
tokens only at the end): clients that stream work unchanged, they just see all tokens at once.
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from slime.backends.cpu_engine.engine import CpuEngine
from slime.backends.cpu_engine.protocol import (
    GenerationRequest,
    RequestError,
    build_generate_response,
    parse_generate_request,
)
from slime.utils.tool_calls import parse_tool_calls

RunRequests = Callable[[CpuEngine, list[GenerationRequest]], Awaitable[list[GenerationRequest]]]
ReadBody = Callable[[web.Request], Awaitable[dict[str, Any]]]

_ROLES = ("system", "developer", "user", "assistant", "tool")
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
}


class OpenAIError(RequestError):
    """A RequestError that also names the offending request field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message, status)
        self.param = param


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    """OpenAI's error body; `type` follows the status (invalid_request_error for 4xx)."""
    kind = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}.get(status)
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": None if status >= 500 else status}}
    return web.json_response(body, status=status)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise OpenAIError(f"'{name}' must be a number in [{low}, {high}], got {value!r}", name)
    if not low <= value <= high:
        raise OpenAIError(f"'{name}' must be in [{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise OpenAIError(f"'{name}' must be an integer in [{low}, {high}], got {value!r}", name)
    return value


def _sampling(body: dict, engine: CpuEngine) -> dict[str, Any]:
    """OpenAI sampling fields -> SGLang `sampling_params` (without the per-choice seed)."""
    for name, neutral in _UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise OpenAIError(f"'{name}' is not supported by the CPU engine; omit it", name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise OpenAIError("'best_of' is not supported by the CPU engine; omit it or set it equal to 'n'", "best_of")
    params: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0, 2, 1.0),
        "top_p": _number(body, "top_p", 0, 1, 1.0),
    }
    if params["top_p"] == 0:
        raise OpenAIError("'top_p' must be in (0, 1], got 0", "top_p")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, 0, engine.context_length, None)
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise OpenAIError(f"'stop' must be a non-empty string or a list of up to 4, got {stop!r}", "stop")
        params["stop"] = stops
    return params


def _choices(body: dict) -> tuple[int, int | None]:
    n = _integer(body, "n", 1, 128, 1)
    seed = _integer(body, "seed", 0, 2**63 - 129, None)
    return n, seed


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise OpenAIError(f"'stream' must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", "stream_options")
    return stream, bool(options.get("include_usage"))


def _build_requests(
    engine: CpuEngine, prompts: list[list[int]], params: dict, n: int, seed: int | None, logprobs: bool
) -> list[GenerationRequest]:
    """n requests per prompt, through the native parser; choice i of a seeded request uses `seed + i`.

    Without `max_tokens` a choice may run to the end of the context, as OpenAI's default.
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
    }
    requests, _ = parse_generate_request(native, engine.tokenizer, engine.vocab_size, engine.context_length)
    return requests


def _text(request: GenerationRequest, engine: CpuEngine) -> str:
    """The output text with the matched stop token / stop string cut off, as /generate returns it."""
    return build_generate_response(request, engine.tokenizer)["text"]


def _finish_reason(request: GenerationRequest) -> str:
    kind = (request.finish_reason or {}).get("type", "abort")
    return kind if kind in ("stop", "length") else "abort"


def _usage(prompts: list[list[int]], finished: list[GenerationRequest]) -> dict[str, int]:
    # As OpenAI counts: each prompt once, however many choices it has.
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(r.output_ids) for r in finished)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_texts(request: GenerationRequest, engine: CpuEngine) -> list[str]:
    return [engine.tokenizer.decode([t]) for t in request.output_ids]


# ----- chat ----------------------------------------------------------------------------------


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise OpenAIError(f"{where} must be an object with 'role' one of {', '.join(_ROLES)}", where)
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is understood here
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise OpenAIError(f"{where}.content parts must all be {{'type': 'text', 'text': ...}}", where)
            content = "".join(p["text"] for p in content)
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
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    )
    if not ok:
        raise OpenAIError("'tools' must be a list of {'type': 'function', 'function': {'name', ...}}", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise OpenAIError("'tool_choice' must be 'auto' or 'none' on the CPU engine", "tool_choice")
    return None if choice == "none" or not tools else tools


def _chat_prompt(engine: CpuEngine, messages: list[dict], tools: list[dict] | None) -> list[int]:
    try:
        text = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as error:  # jinja errors: a role order or field the template does not accept
        raise OpenAIError(f"the model's chat template rejected the messages: {error}", "messages") from None
    # The template writes any BOS itself.
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _chat_choice(index: int, request: GenerationRequest, engine: CpuEngine, tools: list | None, logprobs: bool) -> dict:
    text = _text(request, engine)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = _finish_reason(request)
    if tools:
        content, calls = parse_tool_calls(text)
        if calls:
            message["content"] = content
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
            finish = "tool_calls"
    choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if logprobs:
        choice["logprobs"] = {
            "content": [
                {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
                for token, lp in zip(_token_texts(request, engine), request.output_logprobs)
            ]
        }
    return choice


def _sse(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


async def _send_stream(request: web.Request, events: list[dict]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    await response.write(_sse(events))
    await response.write_eof()
    return response


def _chat_stream_events(answer: dict, include_usage: bool) -> list[dict]:
    head = {k: answer[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    events = []
    for choice in answer["choices"]:
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        events.append(
            {
                **head,
                "choices": [
                    {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
                ],
            }
        )
        events.append(
            {**head, "choices": [{"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}]}
        )
    if include_usage:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return events


# ----- routes --------------------------------------------------------------------------------


def add_routes(
    app: web.Application, engine: CpuEngine, run_requests: RunRequests, read_body: ReadBody, max_queued: int
) -> None:
    """Register the /v1 routes on `app`.

    `run_requests` and `read_body` are the server's own helpers; beyond `max_queued` waiting requests
    a call answers 503 with Retry-After, as /generate does.
    """
    model_name = engine.model_path

    def openai_errors(handler):
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except RequestError as error:
                response = error_response(error.message, error.status, getattr(error, "param", None))
                if error.status == 503:
                    response.headers["Retry-After"] = "1"
                return response

        return wrapped

    async def run(requests: list[GenerationRequest]) -> list[GenerationRequest]:
        waiting = engine.load()["num_waiting_reqs"]
        if waiting + len(requests) > max_queued:
            raise RequestError(
                f"the engine's queue is full ({waiting} requests waiting, --max-queued-requests {max_queued}); "
                "retry later",
                status=503,
            )
        finished = await run_requests(engine, requests)
        failed = next((r.error for r in finished if r.error), None)
        if failed:
            raise RequestError(f"generation failed: {failed}", status=500)
        return finished

    @openai_errors
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        messages, tools = _messages(body), _tools(body)
        params = _sampling(body, engine)
        n, seed = _choices(body)
        stream, include_usage = _stream_options(body)
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise OpenAIError(f"'logprobs' must be true or false, got {logprobs!r}", "logprobs")
        if body.get("top_logprobs"):
            raise OpenAIError("'top_logprobs' is not supported by the CPU engine; omit it or send 0", "top_logprobs")
        prompt = _chat_prompt(engine, messages, tools)
        finished = await run(_build_requests(engine, [prompt], params, n, seed, logprobs))
        answer = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or model_name,
            "choices": [_chat_choice(i, r, engine, tools, logprobs) for i, r in enumerate(finished)],
            "usage": _usage([prompt], finished),
        }
        if stream:
            return await _send_stream(request, _chat_stream_events(answer, include_usage))
        return web.json_response(answer)

    @openai_errors
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        prompts = _completion_prompts(body, engine)
        params = _sampling(body, engine)
        n, seed = _choices(body)
        stream, include_usage = _stream_options(body)
        logprobs = _integer(body, "logprobs", 0, 0, None)
        finished = await run(_build_requests(engine, prompts, params, n, seed, logprobs is not None))
        choices = []
        for i, r in enumerate(finished):
            choice: dict[str, Any] = {
                "index": i,
                "text": _text(r, engine),
                "finish_reason": _finish_reason(r),
                "logprobs": None,
            }
            if logprobs is not None:
                tokens = _token_texts(r, engine)
                offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": list(r.output_logprobs),
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            choices.append(choice)
        answer = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or model_name,
            "choices": choices,
            "usage": _usage(prompts, finished),
        }
        if stream:
            head = {k: answer[k] for k in ("id", "object", "created", "model")}
            events = [{**head, "choices": [c]} for c in choices]
            if include_usage:
                events.append({**head, "choices": [], "usage": answer["usage"]})
            return await _send_stream(request, events)
        return web.json_response(answer)

    async def models(request: web.Request) -> web.Response:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "slime", "root": model_name}
        card["max_model_len"] = engine.context_length
        return web.json_response({"object": "list", "data": [card]})

    async def not_found(request: web.Request) -> web.Response:
        routes = "/v1/chat/completions, /v1/completions, /v1/models"
        return error_response(f"no route {request.method} {request.path} on this engine; it serves {routes}", 404)

    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/v1/{tail:(?!loads$).*}", not_found)


def _completion_prompts(body: dict, engine: CpuEngine) -> list[list[int]]:
    """`prompt` as a string, a list of strings, a list of token ids or a list of such lists."""
    prompt = body.get("prompt")
    bad = OpenAIError("'prompt' must be a non-empty string, token id list, or a list of either", "prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad
    if all(_is_int(t) for t in prompt):
        prompt = [prompt]
    out = []
    for item in prompt:
        if isinstance(item, str) and item:
            out.append(engine.tokenizer.encode(item))
        elif isinstance(item, list) and item and all(_is_int(t) and 0 <= t < engine.vocab_size for t in item):
            out.append(item)
        else:
            raise bad
    return out
