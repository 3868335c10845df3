"""aiohttp server speaking SGLang's native HTTP API on top of `CpuEngine`.

The event loop only parses, queues and answers; the model runs on the engine's worker thread,
so /abort_request, /health and control calls stay responsive during long generations.

Endpoints (request/response shapes follow SGLang):
    POST /generate                       text | input_ids (single or batch), sampling_params, return_logprob,
                                         logprob_start_len, return_text_in_logprobs, rid, image_data (vision-language
                                         models: images per prompt, see vision.py). `stream` is refused;
                                         unknown top-level fields are ignored (the router adds some).
    GET  /health                         200 while the server runs.
    GET  /health_generate                a 1-token generation; 200 without generating while paused; 503 while released.
    GET  /get_model_info, /get_server_info (also /model_info, /server_info), /get_weight_version,
         /v1/loads, /get_load
    GET|POST /flush_cache                400 while requests are running (there is no prefix cache to flush).
    POST /abort_request                  {"rid"} or {"abort_all": true}
    POST /pause_generation               {"mode": "abort" (default) | "in_place" | "retract"}
    POST /continue_generation
    POST /update_weights_from_tensor     {"serialized_named_tensors": [base64 pickles], "weight_version"?}, or with
                                         "load_format": "slime_shared_memory" JSON layouts of shared-memory segments
                                         (answer adds "segments_in_use": the ones the weights now live in)
    POST /init_weights_update_group      {"master_address", "master_port", "rank_offset", "world_size", "group_name",
                                          "backend": "gloo"}
    POST /update_weights_from_distributed  {"names", "dtypes", "shapes", "group_name", "weight_version"?}
    POST /destroy_weights_update_group   {"group_name"}
    POST /update_weights_from_disk       {"model_path", "load_format"?, "weight_version"?}; a slime delta folder
                                         (`slime.utils.weight_delta`) is rebuilt from the live weights
    POST /release_memory_occupation, /resume_memory_occupation  {"tags"?}
    POST /update_weight_version          {"new_version", "abort_all_requests"?}: relabel the live weights
    POST /load_lora_adapter              {"lora_name", "lora_path": PEFT adapter folder, "pinned"?}
    POST /load_lora_adapter_from_tensors {"lora_name", "config_dict", "serialized_tensors", "load_format": null}
    POST /unload_lora_adapter            {"lora_name"}: requests in flight that use it are aborted
                                         (LoRA endpoints answer {"success", "error_message", "loaded_adapters"};
                                         they and `lora_path` in requests need --enable-lora)
    POST /v1/chat/completions, /v1/completions; GET /v1/models   OpenAI-compatible (see openai_api.py), with
                                         token-by-token `stream: true` and top log-probs.

Errors: /generate answers {"error": {"message"}}; control endpoints answer {"success": false, "message"}.
Weight updates without an explicit `weight_version` bump it ("default" -> "1" -> "2" ...).

Hardening (the engine maps weight handles from request bodies and accepts weight pushes):
- With `--api-key KEY` every endpoint but GET /health needs `Authorization: Bearer KEY` (401 otherwise);
  a host other than loopback is refused at startup without one.
- /generate bodies are capped at 16 MiB and control bodies at 64 MiB (413); large bodies are parsed off
  the event loop, so /health keeps answering while one arrives.
- At most `--max-queued-requests` requests wait for a batch slot; beyond that /generate answers 503
  with Retry-After.
- /init_weights_update_group gives up after its `timeout` (seconds, default 60) and joins on a thread
  of its own, so an unreachable trainer neither jams the server nor delays SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import hmac
import ipaddress
import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from slime.backends.cpu_engine import lora, openai_api, weights
from slime.backends.cpu_engine.engine import CpuEngine, TokenWatch
from slime.backends.cpu_engine.protocol import (
    GenerationRequest,
    RequestError,
    build_generate_response,
    parse_generate_request,
)
from slime.backends.cpu_engine.sampling import SamplingParams
from slime.utils import fp8, weight_delta, weight_transport
from slime.utils.engine_args import CPU_ENGINE_CONTROL_MAX_BODY_BYTES, ENGINE_API_KEY_ENV
from slime.utils.openai_protocol import PARSE_OFF_LOOP_BYTES, lone_surrogate
from slime.utils.perf import cpu_has_bf16_matmul

logger = logging.getLogger(__name__)

VERSION = "slime-cpu-engine 0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0
GENERATE_MAX_BODY_BYTES = 16 * 2**20
CONTROL_MAX_BODY_BYTES = CPU_ENGINE_CONTROL_MAX_BODY_BYTES
JOIN_TIMEOUT_S = 60.0
# A SIGTERM waits this long for open requests (all aborted first) before it cancels them.
SHUTDOWN_TIMEOUT_S = 3.0
_ENGINE = web.AppKey("engine", CpuEngine)
_STATE = web.AppKey("state", dict)


@dataclass
class ServerArgs:
    """Settings of one CPU engine server.

    Args:
        model_path: Local HF folder with safetensors weights and a tokenizer.
        tokenizer_path: Tokenizer folder when it is not `model_path`.
        host: Address to bind; keep 127.0.0.1 unless other hosts must reach the engine (then set `api_key`).
        port: Port to bind; 0 picks a free one (see `ServerHandle.url`).
        max_running_requests: Most sequences decoding together.
        max_prefill_tokens: Most padded prompt tokens in one prefill forward.
        context_length: Longest prompt + output; default: the config's `max_position_embeddings`.
        num_threads: torch intra-op threads (the whole process); give every process on a machine its share.
        dtype: "float32" (default), "bfloat16" or "float16".
        random_seed: Seed for requests that carry no `sampling_seed`.
        log_level: Logging level `run_server` configures (`launch_server` leaves logging to the host).
        api_key: When set, every endpoint but GET /health requires `Authorization: Bearer <api_key>`.
            Required for any host other than loopback.
        max_queued_requests: Most requests waiting for a batch slot; more get 503 with Retry-After.
        trust_remote_code: Let transformers run Python code shipped in the model folder (its `auto_map`).
        enable_lora: Serve LoRA adapters, chosen per request with `lora_path` (implied by `lora_paths`).
        max_lora_rank: Highest adapter rank the engine accepts; None for any.
        lora_target_modules: Linear leaf names (`q_proj`, ...) adapters may target, or ["all-linear"]; None for all.
        max_loras_per_batch: Most distinct adapters in one running batch; requests of further ones wait.
        max_loaded_loras: Most adapters held at once; loading another needs an unload first.
        lora_paths: Adapters loaded at start, each `name=path` or `path` (then named by its path).
        quantization: "fp8" runs the model in block FP8 as SGLang's `--quantization fp8` does (a bf16/fp32
            checkpoint is rounded through FP8 on load, and so is every update not sent in FP8); None keeps the
            checkpoint's precision. A block-FP8 checkpoint (its config's `quantization_config`) runs FP8 either way.
        true_on_policy_threads: Report each finished response's log-probs as the FSDP trainer computes them, on
            this many threads (slime's `--true-on-policy-mode`); None reports the decode-time ones.
    """

    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    max_running_requests: int = 32
    max_prefill_tokens: int = 16384
    context_length: int | None = None
    num_threads: int = 1
    dtype: str = "float32"
    random_seed: int = 0
    log_level: str = "info"
    api_key: str | None = None
    max_queued_requests: int = 4096
    trust_remote_code: bool = False
    enable_lora: bool = False
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int = 16
    lora_paths: list[str] | None = None
    quantization: str | None = None
    true_on_policy_threads: int | None = None


def lora_enabled(args: ServerArgs) -> bool:
    """--enable-lora, or --lora-paths (which implies it, as in SGLang)."""
    return args.enable_lora or bool(args.lora_paths)


def parse_lora_paths(items: list[str]) -> list[tuple[str, str]]:
    """`--lora-paths` items (`name=path` or `path`) -> (name, path); ValueError naming a bad or repeated item."""
    pairs = []
    for item in items:
        name, _, path = item.partition("=") if "=" in item else (item, "", item)
        if not name or not path:
            raise ValueError(f"--lora-paths item {item!r} must be NAME=PATH or PATH")
        if name in (n for n, _ in pairs):
            raise ValueError(f"--lora-paths names the adapter {name!r} twice; give each adapter its own name")
        pairs.append((name, path))
    return pairs


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to any interface
        return False


def check_server_args(args: ServerArgs) -> None:
    """Refuse settings that cannot work or would expose the engine; ValueError naming the setting and the fix."""
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key is empty; pass a non-empty key or leave the flag out")
    if not args.api_key and not _is_loopback(args.host):
        raise ValueError(
            f"refusing to serve on host {args.host!r} without --api-key: the engine maps weight handles sent in "
            "request bodies (/update_weights_from_tensor) and accepts weight pushes from anyone who can reach it. "
            "Pass --api-key KEY (from slime: --sglang-api-key KEY), or bind --host 127.0.0.1."
        )
    if args.true_on_policy_threads is not None and args.true_on_policy_threads < 1:
        raise ValueError(f"--true-on-policy-threads must be at least 1, got {args.true_on_policy_threads}")
    for name in (
        "max_running_requests",
        "max_queued_requests",
        "num_threads",
        "max_loras_per_batch",
        "max_loaded_loras",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be >= 1, got {args.max_lora_rank}")
    if args.lora_target_modules is not None and not all(args.lora_target_modules):
        raise ValueError(f"--lora-target-modules {args.lora_target_modules}: give Linear leaf names or all-linear")
    if not lora_enabled(args):
        given = [
            flag
            for flag, used in (
                ("--max-lora-rank", args.max_lora_rank is not None),
                ("--lora-target-modules", args.lora_target_modules is not None),
                ("--max-loras-per-batch", args.max_loras_per_batch != ServerArgs.max_loras_per_batch),
                ("--max-loaded-loras", args.max_loaded_loras != ServerArgs.max_loaded_loras),
            )
            if used
        ]
        if given:
            raise ValueError(f"{' and '.join(given)} only apply with --enable-lora; add it or drop them")
    parse_lora_paths(args.lora_paths or [])
    if args.quantization not in (None, "fp8"):
        raise ValueError(
            f"--quantization {args.quantization!r}: the CPU engine runs only fp8 (block-wise); drop it or use fp8"
        )


def build_engine(args: ServerArgs) -> CpuEngine:
    """Check `args`, set the thread budget, load the model described by them and the `--lora-paths` adapters."""
    check_server_args(args)
    torch.set_num_threads(args.num_threads)
    with contextlib.suppress(RuntimeError):  # only allowed before any inter-op work started
        torch.set_num_interop_threads(1)
    dtype = weights.parse_dtype(args.dtype)
    if dtype == torch.float16 or (dtype == torch.bfloat16 and not cpu_has_bf16_matmul()):
        logger.warning(
            "dtype %s: this CPU has no %s matmul units and runs it far slower than float32", args.dtype, args.dtype
        )
    engine = CpuEngine(
        args.model_path,
        dtype=dtype,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context_length,
        random_seed=args.random_seed,
        num_threads=args.num_threads,
        tokenizer_path=args.tokenizer_path,
        trust_remote_code=args.trust_remote_code,
        enable_lora=lora_enabled(args),
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
        true_on_policy_threads=args.true_on_policy_threads,
    )
    if args.quantization == "fp8":
        engine.call(lambda: weights.enable_fp8(engine.model)).result()
    for name, path in parse_lora_paths(args.lora_paths or []):
        try:
            config, tensors = lora.read_adapter_folder(path, engine.lora_store().max_adapter_bytes())
            engine.add_lora_adapter(engine.lora_store().build(name, path, config, tensors)).result()
        except ValueError as error:
            engine.shutdown()
            raise ValueError(f"--lora-paths {name}={path}: {error}") from None
    return engine


class _HideHttp2Probes(logging.Filter):
    """sglang-router probes workers with HTTP/2 frames, which aiohttp logs as a failed request."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and "PRI/Upgrade" in str(error))


_HTTP2_PROBE_FILTER = _HideHttp2Probes()


def create_app(engine: CpuEngine, args: ServerArgs) -> web.Application:
    """The aiohttp application serving `engine`; shuts the engine down on cleanup.

    Serve it with `handler_cancellation=True` so a client that disconnects aborts its requests.
    """
    logging.getLogger("aiohttp.server").addFilter(_HTTP2_PROBE_FILTER)
    check_server_args(args)
    # Bodies are read by `_json_body` with per-endpoint limits; this is aiohttp's own ceiling.
    app = web.Application(middlewares=[_auth_middleware, _error_middleware], client_max_size=CONTROL_MAX_BODY_BYTES)
    app[_ENGINE] = engine
    # "joining": group names whose /init_weights_update_group is still running; "join_waits": their futures.
    # "segments": the mappings of trainers' shared memory (/update_weights_from_tensor), kept across pushes.
    app[_STATE] = {
        "args": args,
        "groups": {},
        "joining": set(),
        "join_waits": set(),
        "segments": weight_transport.MappedSegments(),
    }
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    # sglang-router asks /model_info and /server_info first, then falls back to the get_ names.
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, get_model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, get_server_info)
    app.router.add_get("/get_weight_version", get_weight_version)
    app.router.add_get("/v1/loads", get_load)
    app.router.add_get("/get_load", get_load)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/release_memory_occupation", release_memory_occupation)
    app.router.add_post("/resume_memory_occupation", resume_memory_occupation)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/load_lora_adapter_from_tensors", load_lora_adapter_from_tensors)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
    # OpenAI-compatible /v1 routes, on the same queue and behind the same API key.
    read_body = functools.partial(_json_body, limit=GENERATE_MAX_BODY_BYTES)
    openai_api.add_routes(app, engine, _run_requests, read_body, args.max_queued_requests)

    async def abort_all(app: web.Application) -> None:
        # Open /generate calls and group joins return now instead of holding the shutdown until they end.
        app[_ENGINE].abort(abort_all=True)
        for wait in app[_STATE]["join_waits"]:
            if not wait.done():
                wait.set_exception(RequestError("the engine is shutting down", status=503))

    async def stop_engine(app: web.Application) -> None:
        await asyncio.to_thread(app[_ENGINE].shutdown)
        app[_STATE]["segments"].close()

    app.on_shutdown.append(abort_all)
    app.on_cleanup.append(stop_engine)
    return app


# ----- helpers -------------------------------------------------------------------------------


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def _auth_middleware(request: web.Request, handler):
    """With an API key, everything but GET /health needs `Authorization: Bearer <key>`."""
    key = request.app[_STATE]["args"].api_key
    if not key or (request.method in ("GET", "HEAD") and request.path == "/health"):
        return await handler(request)
    given = request.headers.get("Authorization", "").encode("utf-8", errors="replace")
    if hmac.compare_digest(given, f"Bearer {key}".encode()):  # constant time: no key prefix leaks by timing
        return await handler(request)
    message = (
        "missing or wrong API key: this engine was started with --api-key; send the header 'Authorization: Bearer <key>'"
        if given
        else "missing API key: this engine was started with --api-key; send the header 'Authorization: Bearer <key>'"
    )
    return web.json_response({"error": {"message": message}}, status=401, headers={"WWW-Authenticate": "Bearer"})


@web.middleware
async def _error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as error:
        return _error(error.message, error.status)
    except web.HTTPException:
        raise
    except Exception as error:
        logger.exception("%s failed", request.path)
        return _error(f"{request.path} failed: {error!r}", 500)


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    too_large = RequestError(
        f"the body of {request.path} exceeds {limit // 2**20} MiB; send smaller requests (split large batches)",
        status=413,
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:  # chunked bodies carry no Content-Length
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(raw: bytes, path: str) -> Any:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError(f"the body of {path} is nested too deeply to parse") from None
    except ValueError as error:  # JSONDecodeError, bad UTF-8, integers longer than Python converts
        raise RequestError(f"the body of {path} is not valid JSON: {error}") from None
    if lone_surrogate(raw, body):
        raise RequestError(f"the body of {path} holds a lone UTF-16 surrogate (e.g. \\ud800), which is no text")
    return body


async def _json_body(request: web.Request, limit: int = CONTROL_MAX_BODY_BYTES) -> dict[str, Any]:
    """The JSON object in the body (at most `limit` bytes); an empty body counts as {}."""
    raw = await _read_body(request, limit)
    request["body_bytes"] = len(raw)  # a chunked body has no Content-Length to size the parse by
    if not raw.strip():
        return {}
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        body = await asyncio.to_thread(_parse_json, raw, request.path)
    else:
        body = _parse_json(raw, request.path)
    if not isinstance(body, dict):
        raise RequestError(f"the body of {request.path} must be a JSON object")
    return body


def _field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """`body[name]`, checked against `kind`; missing (or null) gives `default`, or a 400 when there is none."""
    value = body.get(name)
    if value is None:
        if default is ...:
            raise RequestError(f"missing required field '{name}'")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(f"field '{name}' must be {names}, got {value!r}")
    return value


def _control(handler: Callable[[web.Request], Awaitable[str | dict]]):
    """Wrap a control endpoint: answer SGLang's {"success", "message"}; 400 for caller errors."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.Response:
        try:
            result = await handler(request)
        except (RequestError, ValueError) as error:
            status = error.status if isinstance(error, RequestError) else 400
            return web.json_response({"success": False, "message": str(error)}, status=status)
        except Exception as error:
            logger.exception("%s failed", request.path)
            return web.json_response({"success": False, "message": f"{request.path} failed: {error!r}"}, status=500)
        # One line per control call: what an operator reads to see the pushes, pauses and offloads an engine took.
        logger.info("%s: %s", request.path, result if isinstance(result, str) else "done")
        body = {"success": True, "message": result} if isinstance(result, str) else {"success": True, **result}
        return web.json_response(body)

    return wrapped


async def _run_requests(
    engine: CpuEngine, requests: list[GenerationRequest], watch: TokenWatch | None = None
) -> list[GenerationRequest]:
    """Submit requests (with `watch`, see `CpuEngine.submit`) and wait until all have finished; abort them if
    the caller goes away."""
    loop = asyncio.get_running_loop()
    futures = []
    for request in requests:
        future = loop.create_future()
        request.on_finish = functools.partial(_resolve_from_thread, loop, future)
        futures.append(future)
    engine.submit(requests, watch)
    try:
        return await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for request in requests:
            engine.abort(request.rid)
        raise


def _in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """Run a blocking `fn` on a fresh daemon thread: unlike the default executor, shutting down never waits for it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(error: BaseException | None, result: Any) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as raised:
            result, error = None, raised
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody is waiting
            loop.call_soon_threadsafe(settle, error, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _resolve_from_thread(loop: asyncio.AbstractEventLoop, future: asyncio.Future, request: GenerationRequest) -> None:
    def resolve() -> None:
        if not future.done():
            future.set_result(request)

    with contextlib.suppress(RuntimeError):  # the loop is already closed: nobody is waiting
        loop.call_soon_threadsafe(resolve)


# ----- generation ----------------------------------------------------------------------------


async def generate(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    body = await _json_body(request, GENERATE_MAX_BODY_BYTES)
    parse = functools.partial(
        parse_generate_request, body, engine.tokenizer, engine.vocab_size, engine.context_length, engine.vision
    )
    # Checking millions of token ids, or decoding images, takes a while; keep the event loop free for /health meanwhile.
    slow = request["body_bytes"] > PARSE_OFF_LOOP_BYTES or bool(body.get("image_data"))
    requests, is_batch = await asyncio.to_thread(parse) if slow else parse()
    limit = request.app[_STATE]["args"].max_queued_requests
    if len(requests) > limit:
        raise RequestError(f"a batch of {len(requests)} prompts exceeds --max-queued-requests {limit}; split it")
    waiting = engine.load()["num_waiting_reqs"]
    if waiting + len(requests) > limit:
        message = f"the engine's queue is full ({waiting} requests waiting, --max-queued-requests {limit}); retry later"
        return web.json_response({"error": {"message": message}}, status=503, headers={"Retry-After": "1"})
    finished = await _run_requests(engine, requests)
    failed = next((r for r in finished if r.error), None)
    if failed is not None:
        return _error(failed.error, failed.error_status)
    responses = [build_generate_response(r, engine.tokenizer) for r in finished]
    return web.json_response(responses if is_batch else responses[0])


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    if engine.released:
        return _error("weights are released (/release_memory_occupation)", 503)
    if engine.paused:
        return web.Response(status=200)
    probe = GenerationRequest(
        rid=f"health-{uuid.uuid4().hex}",
        input_ids=[engine.pad_token_id],
        params=SamplingParams(max_new_tokens=1, temperature=0.0),
        max_new_tokens=1,
    )
    try:
        [done] = await asyncio.wait_for(_run_requests(engine, [probe]), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        return _error(f"no generation within {HEALTH_GENERATE_TIMEOUT_S:.0f}s", 503)
    if done.error or done.finish_reason["type"] == "abort":
        return _error(f"health generation did not complete: {done.error or done.finish_reason}", 503)
    return web.Response(status=200)


async def get_model_info(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    args = request.app[_STATE]["args"]
    config = engine.model.config
    return web.json_response(
        {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": engine.vision is not None,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "dtype": args.dtype,
        }
    )


async def get_server_info(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    args = request.app[_STATE]["args"]
    info = asdict(args)
    info["api_key"] = None if args.api_key is None else "<set>"  # never hand out the key
    info.update(
        model_path=engine.model_path,
        tokenizer_path=engine.tokenizer_path,
        context_length=engine.context_length,
        vocab_size=engine.vocab_size,
        tp_size=1,
        dp_size=1,
        pp_size=1,
        ep_size=1,
        version=VERSION,
        weight_version=engine.weight_version,
        lora_enabled=engine.lora is not None,
        max_loras_per_batch=engine.lora.max_per_batch if engine.lora is not None else None,
        loaded_adapters=engine.lora_adapters(),
        internal_states=[
            {
                "paused": engine.paused,
                "released": engine.released,
                # SGLang's layout, in GB; here the weights' live storage (0 while released), no KV cache between batches
                "memory_usage": {"weight": weights.parameter_bytes(engine.model) / 2**30, "kvcache": 0.0},
                **engine.load(),
                "num_generated_tokens_in_flight": engine.generated_tokens_in_flight(),
            }
        ],
    )
    return web.json_response(info)


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[_ENGINE].weight_version})


async def get_load(request: web.Request) -> web.Response:
    return web.json_response(request.app[_ENGINE].load())


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    load = engine.load()
    # Requests held back by a pause do not count, as in SGLang (they wait outside the scheduler there).
    busy = load["num_running_reqs"] + (0 if engine.paused else load["num_waiting_reqs"])
    if busy:
        return web.Response(status=400, text=f"Cache not flushed: {busy} request(s) are running")
    return web.Response(status=200, text="Cache flushed.")


@_control
async def abort_request(request: web.Request) -> str:
    body = await _json_body(request)
    rid = _field(body, "rid", str, "")
    abort_all = _field(body, "abort_all", bool, False)
    if not rid and not abort_all:
        raise RequestError("send 'rid' (a request id) or 'abort_all': true")
    count = request.app[_ENGINE].abort(rid or None, abort_all=abort_all)
    return f"aborted {count} request(s)"


@_control
async def pause_generation(request: web.Request) -> str:
    body = await _json_body(request)
    mode = _field(body, "mode", str, "abort")
    await asyncio.wrap_future(request.app[_ENGINE].pause(mode))
    return f"paused ({mode})"


@_control
async def continue_generation(request: web.Request) -> str:
    request.app[_ENGINE].continue_generation()
    return "continued"


# ----- weights -------------------------------------------------------------------------------


def _before_update(engine: CpuEngine, body: dict) -> str | None:
    """Handle the fields every SGLang weight update takes; returns the explicit weight_version, if any."""
    if _field(body, "abort_all_requests", bool, False):
        engine.abort(abort_all=True)
    _field(body, "flush_cache", bool, True)  # nothing to flush: there is no prefix cache
    version = _field(body, "weight_version", (str, int), None)
    return None if version is None else str(version)


def _per_payload(payloads: list, read: Callable[[Any], Any], error: type[Exception]) -> list:
    """`read(payload)` of every `serialized_named_tensors` entry; a ValueError becomes `error` naming the entry."""
    results = []
    for i, payload in enumerate(payloads):
        try:
            results.append(read(payload))
        except ValueError as problem:
            raise error(f"serialized_named_tensors[{i}]: {problem}") from None
    return results


def _shared_memory_format(body: dict) -> bool:
    """Whether a tensor upload's `load_format` names a trainer's shared-memory segments (else base64 pickles)."""
    load_format = _field(body, "load_format", str, None)
    if load_format not in (None, "direct", weight_transport.SHARED_MEMORY_FORMAT):
        raise RequestError(
            f"load_format={load_format!r} is not supported; send base64 pickles of (name, tensor) pairs "
            f"(serialize_named_tensors) with load_format null, or stage_named_tensors payloads with load_format "
            f"{weight_transport.SHARED_MEMORY_FORMAT!r}"
        )
    return load_format == weight_transport.SHARED_MEMORY_FORMAT


@_control
async def update_weights_from_tensor(request: web.Request) -> dict:
    engine = request.app[_ENGINE]
    body = await _json_body(request)
    payloads = _field(body, "serialized_named_tensors", list)
    shared = _shared_memory_format(body)
    for i, payload in enumerate(payloads):
        if not isinstance(payload, str):
            raise RequestError(f"serialized_named_tensors[{i}] must be a {'JSON' if shared else 'base64'} string")

    if shared:

        def parse() -> list[weight_transport.SharedPayload]:
            tag = weight_transport.segment_tag(request.app[_STATE]["args"].api_key)
            return _per_payload(
                payloads, lambda payload: weight_transport.parse_shared_payload(payload, tag), RequestError
            )

        small = sum(len(payload) for payload in payloads) <= PARSE_OFF_LOOP_BYTES
        parsed = parse() if small else await asyncio.to_thread(parse)
        segments = request.app[_STATE]["segments"]

        def named_tensors() -> list[tuple[str, torch.Tensor]]:
            # runs on the engine's worker thread, the one thread that uses `segments`
            return [pair for pairs in _per_payload(parsed, segments.named_tensors, ValueError) for pair in pairs]

        count = sum(len(payload.tensors) for payload in parsed)
        version = _before_update(engine, body)
        new_version, held = await asyncio.wrap_future(
            engine.update_weights_from_segments(named_tensors, segments, version)
        )
        # The sender must not write these segments: the weights live in them now.
        return {"message": f"updated {count} tensors", "weight_version": new_version, "segments_in_use": held}

    version = _before_update(engine, body)

    def unpack() -> list[tuple[str, torch.Tensor]]:
        named = []
        for i, payload in enumerate(payloads):
            try:
                named.extend(weight_transport.deserialize_named_tensors(payload))
            except Exception as error:
                raise RequestError(f"serialized_named_tensors[{i}] could not be unpacked: {error!r}") from error
        return named

    unpacked = await asyncio.to_thread(unpack)
    new_version = await asyncio.wrap_future(engine.update_weights(unpacked, version))
    return {"message": f"updated {len(unpacked)} tensors", "weight_version": new_version}


@_control
async def init_weights_update_group(request: web.Request) -> str:
    state = request.app[_STATE]
    groups, joining = state["groups"], state["joining"]
    body = await _json_body(request)
    master_address = _field(body, "master_address", str)
    master_port = _field(body, "master_port", int)
    rank_offset = _field(body, "rank_offset", int)
    world_size = _field(body, "world_size", int)
    group_name = _field(body, "group_name", str, "weight_update_group")
    backend = _field(body, "backend", str, "gloo")
    timeout = _field(body, "timeout", (int, float), JOIN_TIMEOUT_S)
    if backend != "gloo":
        raise RequestError(f"backend={backend!r} is not available on CPU; use 'gloo'")
    if not 0 < master_port < 2**16:
        raise RequestError(f"master_port={master_port} is not a TCP port; use one in [1, 65535]")
    if not 0 < rank_offset < world_size <= 2**16:
        raise RequestError(
            f"rank_offset={rank_offset} must be in [1, world_size={world_size}) and world_size at most 65536; "
            "rank 0 is the trainer"
        )
    if group_name in groups or group_name in joining:
        raise RequestError(f"group {group_name!r} already exists or is being joined; destroy it first")
    if not (math.isfinite(timeout) and 0 < timeout <= 24 * 3600):
        raise RequestError(f"timeout={timeout!r} must be a number of seconds in (0, 86400]")

    def join() -> None:
        try:
            group = weight_transport.init_process_group_like_sglang(
                backend,
                master_address,
                master_port,
                rank_offset,
                world_size,
                group_name,
                timeout=datetime.timedelta(seconds=timeout),
            )
            groups[group_name] = group  # registered even if the caller gave up waiting meanwhile
        finally:
            joining.discard(group_name)

    joining.add(group_name)
    wait = _in_daemon_thread(join, name=f"join-{group_name}")
    state["join_waits"].add(wait)
    try:
        # torch's store can wait past its own timeout (a listener that never answers): the call ends at `timeout`
        # whatever the thread does. A join that ends later still registers its group.
        await asyncio.wait_for(asyncio.shield(wait), timeout + 1.0)
    except RequestError:
        raise
    except TimeoutError:
        raise RequestError(
            f"could not join weight update group {group_name!r} at {master_address}:{master_port} within "
            f"{timeout:g}s (rank {rank_offset} of {world_size}): no answer from the store; check that the trainer's "
            "rank 0 listens there and is joining too (this name stays taken until the stalled join ends)",
            status=500,  # as when torch's store gives up first: under load either may end the wait
        ) from None
    except Exception as error:
        raise RequestError(
            f"could not join weight update group {group_name!r} at {master_address}:{master_port} within "
            f"{timeout:g}s (rank {rank_offset} of {world_size}): {str(error).rstrip('.')}; check that the "
            "trainer's rank 0 listens there and is joining too",
            status=500,
        ) from error
    finally:
        state["join_waits"].discard(wait)
    return f"joined group {group_name!r} as rank {rank_offset} of {world_size}"


@_control
async def update_weights_from_distributed(request: web.Request) -> dict:
    engine = request.app[_ENGINE]
    body = await _json_body(request)
    names = _field(body, "names", list)
    dtypes = _field(body, "dtypes", list)
    shapes = _field(body, "shapes", list)
    group_name = _field(body, "group_name", str, "weight_update_group")
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestError(
            f"names, dtypes and shapes must have equal lengths, got {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    group = request.app[_STATE]["groups"].get(group_name)
    if group is None:
        raise RequestError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
    if not all(isinstance(n, str) for n in names) or not all(isinstance(d, str) for d in dtypes):
        raise RequestError("names and dtypes must be lists of strings")
    if not all(isinstance(s, list) and all(isinstance(x, int) and 0 <= x < 2**40 for x in s) for s in shapes):
        raise RequestError("shapes must be a list of lists of non-negative integers below 2**40")
    torch_dtypes = [weights.parse_dtype(d) for d in dtypes]
    version = _before_update(engine, body)

    def receive(buffer: torch.Tensor) -> None:
        dist.broadcast(fp8.fp8_wire_view(buffer), src=0, group=group)

    # Received on the engine's worker thread between steps, checked, then copied into the parameters.
    layout = [(name, dtype, tuple(shape)) for name, dtype, shape in zip(names, torch_dtypes, shapes)]
    new_version = await asyncio.wrap_future(engine.receive_weights(layout, receive, version))
    return {"message": f"updated {len(names)} tensors", "weight_version": new_version}


@_control
async def destroy_weights_update_group(request: web.Request) -> str:
    body = await _json_body(request)
    group_name = _field(body, "group_name", str, "weight_update_group")
    group = request.app[_STATE]["groups"].pop(group_name, None)
    if group is None:
        raise RequestError(f"no weight update group {group_name!r}")
    # Unregisters the name too, so a later /init_weights_update_group may reuse it.
    await asyncio.to_thread(dist.destroy_process_group, group)
    return f"left group {group_name!r}"


@_control
async def update_weights_from_disk(request: web.Request) -> dict:
    engine = request.app[_ENGINE]
    body = await _json_body(request)
    model_path = _field(body, "model_path", str)
    load_format = _field(body, "load_format", str, None)
    if load_format not in (None, "auto", "safetensors"):
        raise RequestError(f"load_format={load_format!r} is not supported; use 'safetensors' or leave it null")
    version = _before_update(engine, body)
    if os.path.isfile(os.path.join(model_path, weight_delta.MANIFEST)):
        new_version = await _load_delta(engine, model_path, version)
        return {"message": f"applied delta {model_path}", "weight_version": new_version, "num_paused_requests": 0}
    new_version = await asyncio.wrap_future(engine.update_weights_from_disk(model_path, version))
    return {"message": f"loaded {model_path}", "weight_version": new_version, "num_paused_requests": 0}


async def _load_delta(engine: CpuEngine, folder: str, version: str | None) -> str:
    """Rebuild a delta folder's tensors from the live weights on the worker thread (refused, 400 naming the tensor,
    when the base version or a checksum does not match), then copy them in as any update."""

    def rebuild() -> list[tuple[str, torch.Tensor]]:
        if engine.released:
            raise RequestError("cannot apply a weight delta: the weights are released; push the full weights")
        return weights.rebuild_delta_folder(weights.weight_targets(engine.model), folder, engine.weight_version)

    named = await asyncio.wrap_future(engine.call(rebuild))
    return await asyncio.wrap_future(engine.update_weights(named, version))


@_control
async def update_weight_version(request: web.Request) -> dict:
    engine = request.app[_ENGINE]
    body = await _json_body(request)
    version = str(_field(body, "new_version", (str, int)))
    if _field(body, "abort_all_requests", bool, False):
        engine.abort(abort_all=True)
    new_version = await asyncio.wrap_future(engine.set_weight_version(version))
    return {"message": f"weight version set to {new_version}", "weight_version": new_version}


def _memory_tags(body: dict) -> list[str]:
    tags = _field(body, "tags", list, ["weights", "kv_cache"])
    unknown = [t for t in tags if t not in ("weights", "kv_cache", "cuda_graph")]
    if unknown:
        raise RequestError(f"unknown tags {unknown}; use 'weights', 'kv_cache' or 'cuda_graph'")
    return tags


@_control
async def release_memory_occupation(request: web.Request) -> str:
    tags = _memory_tags(await _json_body(request))
    if "weights" not in tags:
        return "nothing to release: the KV cache is allocated per batch"
    started = time.time()
    await asyncio.wrap_future(request.app[_ENGINE].release_memory())
    return f"weights released in {time.time() - started:.2f}s"


@_control
async def resume_memory_occupation(request: web.Request) -> str:
    tags = _memory_tags(await _json_body(request))
    if "weights" not in tags:
        return "nothing to resume: the KV cache is allocated per batch"
    started = time.time()
    await asyncio.wrap_future(request.app[_ENGINE].resume_memory())
    return f"weights resumed in {time.time() - started:.2f}s"


# ----- LoRA adapters -------------------------------------------------------------------------


def _lora_endpoint(handler: Callable[[web.Request], Awaitable[dict[str, str]]]):
    """Wrap a LoRA endpoint: answer SGLang's {"success", "error_message", "loaded_adapters"}; 400 for caller errors."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.Response:
        engine = request.app[_ENGINE]
        try:
            loaded = await handler(request)
        except (RequestError, ValueError) as error:
            status = error.status if isinstance(error, RequestError) else 400
            body = {"success": False, "error_message": str(error), "loaded_adapters": engine.lora_adapters()}
            return web.json_response(body, status=status)
        except Exception as error:
            logger.exception("%s failed", request.path)
            message = f"{request.path} failed: {error!r}"
            body = {"success": False, "error_message": message, "loaded_adapters": engine.lora_adapters()}
            return web.json_response(body, status=500)
        logger.info("%s: adapters now %s", request.path, sorted(loaded))
        return web.json_response({"success": True, "error_message": "", "loaded_adapters": loaded})

    return wrapped


async def _adapter_load_request(request: web.Request) -> tuple[CpuEngine, lora.LoraStore, dict, str]:
    """The engine, its adapter store, the body and the new adapter's name (checked free before anything is read)."""
    engine = request.app[_ENGINE]
    store = engine.lora_store()
    body = await _json_body(request)
    name = _field(body, "lora_name", str)
    if not name:
        raise RequestError("lora_name is empty; name the adapter (requests use the name in lora_path)")
    store.check_free(name)  # the worker checks again when it adds the adapter
    return engine, store, body, name


async def _hold_adapter(engine: CpuEngine, build: Callable[[], lora.LoraAdapter]) -> dict[str, str]:
    """Build the adapter off the event loop (reads and checks), then hold it from the next step on."""
    adapter = await asyncio.to_thread(build)
    return await asyncio.wrap_future(engine.add_lora_adapter(adapter))


@_lora_endpoint
async def load_lora_adapter(request: web.Request) -> dict[str, str]:
    engine, store, body, name = await _adapter_load_request(request)
    path = _field(body, "lora_path", str)
    _field(body, "pinned", bool, False)  # every adapter stays resident here: there is nothing to pin against

    def build() -> lora.LoraAdapter:
        config, tensors = lora.read_adapter_folder(path, store.max_adapter_bytes())
        return store.build(name, path, config, tensors)

    return await _hold_adapter(engine, build)


@_lora_endpoint
async def load_lora_adapter_from_tensors(request: web.Request) -> dict[str, str]:
    engine, store, body, name = await _adapter_load_request(request)
    config = _field(body, "config_dict", dict)
    payload = _field(body, "serialized_tensors", str)
    shared = _shared_memory_format(body)
    if _field(body, "added_tokens_config", dict, None):
        raise RequestError("added_tokens_config is not supported: adapters cannot add tokens here; send null")

    views: list[tuple[str, torch.Tensor]] = []
    if shared:  # a colocated trainer's segment: mapped on the worker thread, the one that uses `segments`
        tag = weight_transport.segment_tag(request.app[_STATE]["args"].api_key)
        try:
            parsed = weight_transport.parse_shared_payload(payload, tag)
            segments = request.app[_STATE]["segments"]
            views = await asyncio.wrap_future(engine.call(lambda: segments.named_tensors(parsed)))
        except ValueError as error:
            raise RequestError(f"serialized_tensors: {error}") from None

    def build() -> lora.LoraAdapter:
        if shared:  # `build` copies each view before checking it: the trainer may rewrite the segment later
            return store.build(name, name, config, views)
        try:
            named = weight_transport.deserialize_named_tensors(payload)
        except ValueError as error:
            raise RequestError(f"serialized_tensors could not be unpacked: {error}") from None
        return store.build(name, name, config, named)

    return await _hold_adapter(engine, build)


@_lora_endpoint
async def unload_lora_adapter(request: web.Request) -> dict[str, str]:
    engine = request.app[_ENGINE]
    engine.lora_store()  # without --enable-lora, say so before anything about the body
    name = _field(await _json_body(request), "lora_name", str)
    return await asyncio.wrap_future(engine.remove_lora_adapter(name))


# ----- entry points --------------------------------------------------------------------------


def run_server(args: ServerArgs) -> None:
    """Load the model and serve until SIGINT / SIGTERM (blocking)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = build_engine(args)
    required = " (API key required)" if args.api_key else ""
    logger.info("serving %s on http://%s:%d%s", engine.model_path, args.host, args.port, required)
    web.run_app(
        create_app(engine, args),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


@dataclass
class ServerHandle:
    """A server running on a background thread of this process (see `launch_server`)."""

    url: str
    engine: CpuEngine
    thread: threading.Thread
    _loop: asyncio.AbstractEventLoop
    _stop: asyncio.Event

    def stop(self, timeout: float = 60.0) -> None:
        """Stop serving, shut the engine down and join the thread."""
        self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout)


def launch_server(args: ServerArgs, timeout: float = 600.0) -> ServerHandle:
    """Load the model and serve on a background thread; returns once the server accepts requests.

    Meant for hosts such as a Ray actor that keep running other code. `args.port=0` picks a free port.
    """
    engine = build_engine(args)
    ready: dict[str, Any] = {}
    started = threading.Event()

    async def serve() -> None:
        runner = web.AppRunner(
            create_app(engine, args),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        ready.update(url=f"http://{args.host}:{port}", loop=asyncio.get_running_loop(), stop=asyncio.Event())
        started.set()
        try:
            await ready["stop"].wait()
        finally:
            await runner.cleanup()

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as error:
            ready["error"] = error
            started.set()
            raise

    thread = threading.Thread(target=run, name="cpu-engine-http", daemon=True)
    thread.start()
    if not started.wait(timeout) or "error" in ready:
        engine.shutdown()
        raise RuntimeError(f"CPU engine server did not start on {args.host}:{args.port}: {ready.get('error')!r}")
    return ServerHandle(url=ready["url"], engine=engine, thread=thread, _loop=ready["loop"], _stop=ready["stop"])


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Command-line flags (SGLang's spelling where one exists) -> `ServerArgs`."""
    defaults = ServerArgs(model_path="")
    parser = argparse.ArgumentParser(
        prog="python -m slime.backends.cpu_engine", description="CPU inference engine with SGLang's HTTP API."
    )
    parser.add_argument("--model-path", required=True, help="local HF folder (safetensors + tokenizer)")
    parser.add_argument("--tokenizer-path", default=None, help="tokenizer folder if not the model folder")
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--max-running-requests", type=int, default=defaults.max_running_requests)
    parser.add_argument("--max-prefill-tokens", type=int, default=defaults.max_prefill_tokens)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=defaults.num_threads, help="torch threads for this process")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--random-seed", type=int, default=defaults.random_seed)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--api-key",
        default=os.environ.get(ENGINE_API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on every endpoint but GET /health (default: ${ENGINE_API_KEY_ENV})",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="requests waiting for a batch slot before /generate answers 503",
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run Python code shipped in the model folder (auto_map)"
    )
    parser.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters, chosen per request with lora_path"
    )
    parser.add_argument("--max-lora-rank", type=int, default=None, help="highest adapter rank accepted (default: any)")
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="Linear leaf names adapters may target (q_proj ...), or all-linear (default: all)",
    )
    parser.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=defaults.max_loras_per_batch,
        help="most distinct adapters in one running batch; requests of further ones wait",
    )
    parser.add_argument(
        "--max-loaded-loras",
        type=int,
        default=defaults.max_loaded_loras,
        help="most adapters held at once; loading another needs an unload first",
    )
    parser.add_argument(
        "--lora-paths", nargs="+", default=None, metavar="NAME=PATH", help="PEFT adapter folders loaded at start"
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="run the weights in block FP8 (a bf16/fp32 checkpoint is rounded through FP8 on load)",
    )
    parser.add_argument(
        "--true-on-policy-threads",
        type=int,
        default=None,
        metavar="N",
        help="report each response's log-probs as the FSDP trainer computes them, on N threads (bit-identical)",
    )
    args = ServerArgs(**vars(parser.parse_args(argv)))
    try:
        check_server_args(args)
    except ValueError as error:
        parser.error(str(error))
    return args
