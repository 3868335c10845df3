"""The /generate wire format: parse SGLang-shaped JSON into `GenerationRequest`s and build responses.

Only what this engine implements is accepted. SGLang fields that would change the result
but are not implemented here (streaming, video / audio inputs, penalties, grammars, top-logprobs)
are rejected with HTTP 400 unless they carry their neutral value. `image_data` is taken by engines
serving a vision-language model (see `vision.py`): per prompt one image or a list of them, each
base64 PNG/JPEG or a `data:` URL (a file path is refused: clients must not make the engine read its
host's files). `lora_path` names a loaded LoRA adapter (one per prompt in a batch, null for the base
model; see `lora.py`). Other top-level fields are ignored, as SGLang does: sglang-router re-serializes every request and
adds its own (`model`, `return_bytes`, ...). Unknown *sampling* parameters are refused, as in SGLang.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from slime.backends.cpu_engine.sampling import SamplingParams
from slime.backends.cpu_engine.vision import Vision, VisionInputs
from slime.utils.moe_routing import encode_routed_experts
from slime.utils.openai_protocol import max_token_chars


class RequestError(ValueError):
    """A request the client got wrong; the server answers HTTP `status` with `message`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(eq=False)
class GenerationRequest:
    """One sequence to generate, as the engine sees it.

    Args:
        rid: Request id, unique among the requests in flight.
        input_ids: Prompt token ids.
        params: Sampling parameters.
        return_logprob: Report `output_token_logprobs` (and `input_token_logprobs` when `logprob_start_len >= 0`).
        logprob_start_len: First prompt position to report an input log-prob for; -1 reports none.
        return_text_in_logprobs: Put each token's text in the third slot of the log-prob triples.
        stop_str_window: How many trailing output tokens to decode when looking for stop strings.
        max_new_tokens: `params.max_new_tokens`, capped so prompt + output fits the context.
        return_routed_experts: Report the experts every token was routed to (MoE models; SGLang's R3 field).
        lora_path: Name of the loaded LoRA adapter to generate with; None for the base model.
        vision: The request's images as model inputs (vision-language models); `input_ids` then holds the
            expanded image placeholders.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stop_str_window: int = 0
    max_new_tokens: int = 0
    return_routed_experts: bool = False
    lora_path: str | None = None
    vision: VisionInputs | None = None
    arrival_time: float = field(default_factory=time.time)
    # Filled in by the engine.
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    # [tokens, num_hidden_layers, top_k] pieces, one per forward the request went through
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    error_status: int = 500  # of the HTTP answer: 400 when the request itself was at fault
    weight_version: str = ""
    finish_time: float | None = None
    abort_requested: bool = False
    generator: torch.Generator | None = None
    on_finish: Callable[[GenerationRequest], None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


# SGLang sampling parameters this engine accepts only at their neutral value.
_NEUTRAL_ONLY = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
}
# SGLang sampling parameters that change nothing here and are accepted with any value.
_IGNORED = {"spaces_between_special_tokens", "custom_params", "stream_interval"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate a JSON `sampling_params` object and turn it into `SamplingParams`.

    `None` for a field means its default, as in SGLang.

    Args:
        raw: The decoded JSON value (a dict, or None for all defaults).
        vocab_size: Token ids in `stop_token_ids` must be below this.

    Returns:
        The parsed parameters.

    Raises:
        RequestError: naming the offending field, for unknown fields and bad values.
    """
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be a JSON object, got {type(raw).__name__}")
    params = SamplingParams()
    for name, value in raw.items():
        if name in _IGNORED or value is None:
            continue
        if name in _NEUTRAL_ONLY:
            if value not in (_NEUTRAL_ONLY[name], [], {}, ""):
                raise RequestError(
                    f"sampling_params.{name}={value!r} is not supported by the CPU engine; "
                    f"omit it or send {_NEUTRAL_ONLY[name]!r}"
                )
            continue
        if name not in SamplingParams.__dataclass_fields__:
            raise RequestError(f"unknown field sampling_params.{name}; check the spelling against SGLang's names")
        setattr(params, name, _parse_field(name, value, vocab_size))
    if params.max_new_tokens is not None and params.min_new_tokens > params.max_new_tokens:
        raise RequestError(
            f"sampling_params.min_new_tokens={params.min_new_tokens} exceeds "
            f"max_new_tokens={params.max_new_tokens}; lower min_new_tokens"
        )
    return params


# Largest integer a count may be: what SGLang's int32 fields hold; past it torch overflows inside the batch.
MAX_INT32 = 2**31 - 1


def _parse_field(name: str, value: Any, vocab_size: int) -> Any:
    where = f"sampling_params.{name}"
    if name in ("max_new_tokens", "min_new_tokens"):
        if not _is_int(value) or not 0 <= value <= MAX_INT32:
            raise RequestError(f"{where} must be an integer in [0, {MAX_INT32}], got {value!r}")
        return value
    if name == "temperature":
        if not _is_number(value) or value < 0:
            raise RequestError(f"{where} must be a finite number >= 0 (0 means greedy), got {value!r}")
        # SGLang treats temperatures below 1e-6 as greedy too.
        return 0.0 if value < 1e-6 else float(value)
    if name == "top_p":
        if not _is_number(value) or not 0 < value <= 1:
            raise RequestError(f"{where} must be in (0, 1], got {value!r}")
        return float(value)
    if name == "top_k":
        if not _is_int(value) or not (value == -1 or 1 <= value <= MAX_INT32):
            raise RequestError(f"{where} must be -1 (off) or an integer in [1, {MAX_INT32}], got {value!r}")
        return -1 if value >= vocab_size else value  # at least the vocabulary: every token stays
    if name == "min_p":
        if not _is_number(value) or not 0 <= value <= 1:
            raise RequestError(f"{where} must be in [0, 1], got {value!r}")
        return float(value)
    if name == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError(f"{where} must be a non-empty string or a list of non-empty strings, got {value!r}")
        return stops
    if name == "stop_token_ids":
        if not isinstance(value, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in value):
            raise RequestError(f"{where} must be a list of token ids in [0, {vocab_size}), got {value!r}")
        return value
    if name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        if not isinstance(value, bool):
            raise RequestError(f"{where} must be true or false, got {value!r}")
        return value
    if name == "sampling_seed":
        # torch.Generator.manual_seed takes 64-bit seeds; larger ones would fail inside the engine.
        if not _is_int(value) or not 0 <= value < 2**63:
            raise RequestError(f"{where} must be an integer in [0, 2**63), got {value!r}")
        return value
    raise AssertionError(f"unhandled sampling field {name}")


# Top-level fields that ask for features this engine does not have, unless left at their default.
_UNSUPPORTED_FIELDS = {
    "stream",
    "input_embeds",
    "video_data",
    "audio_data",
    "modalities",
    "lora_id",
    "custom_logit_processor",
    "session_params",
    "return_hidden_states",
    "return_entropy",
    "top_logprobs_num",
    "token_ids_logprob",
    "background",
    "return_bytes",
}


def parse_generate_request(
    body: Any, tokenizer, vocab_size: int, context_length: int, vision: Vision | None = None
) -> tuple[list[GenerationRequest], bool]:
    """Validate a /generate body and split it into one `GenerationRequest` per sequence.

    Args:
        body: The decoded JSON body.
        tokenizer: Used to tokenize `text` and to size the stop-string window.
        vocab_size: Token ids must be below this (the model's embedding rows).
        context_length: Prompt plus generated tokens must fit in this (counting expanded image placeholders).
        vision: The engine's image support; None for a text-only model (which refuses `image_data`).

    Returns:
        (requests, is_batch): `is_batch` is True when `text` / `input_ids` was a list of prompts,
        in which case the response is a list too.

    Raises:
        RequestError: naming the offending field.
    """
    if not isinstance(body, dict):
        raise RequestError("the /generate body must be a JSON object")
    for name in _UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False, 0, [], {}, ""):
            raise RequestError(f"field '{name}' is not supported by the CPU engine; omit it")

    prompts, is_batch = _parse_prompts(body, tokenizer, vocab_size, context_length)
    count = len(prompts)
    images = _parse_image_data(body.get("image_data"), count, is_batch, vision)
    visions: list[VisionInputs | None] = [None] * count
    for i, items in enumerate(images):
        if items:
            where = f"image_data[{i}]" if is_batch else "image_data"
            try:
                prompts[i], visions[i] = vision.prepare(prompts[i], items, where)
            except ValueError as error:
                raise RequestError(str(error)) from None
    sampling_params = _per_item(body, "sampling_params", count, is_batch, None, dict)
    return_logprob = _per_item(body, "return_logprob", count, is_batch, False, bool)
    logprob_start_len = _per_item(body, "logprob_start_len", count, is_batch, -1, int)
    return_routed = _per_item(body, "return_routed_experts", count, is_batch, False, bool)
    lora_paths = _per_item(body, "lora_path", count, is_batch, None, str)
    return_text = body.get("return_text_in_logprobs") or False
    if not isinstance(return_text, bool):
        raise RequestError(f"return_text_in_logprobs must be true or false, got {return_text!r}")
    rids = _parse_rids(body.get("rid"), count, is_batch)

    requests = []
    for i, input_ids in enumerate(prompts):
        where = f"[{i}]" if is_batch else ""
        params = parse_sampling_params(sampling_params[i], vocab_size)
        start = logprob_start_len[i]
        if not _is_int(start) or not -1 <= start < len(input_ids):
            raise RequestError(
                f"logprob_start_len{where} must be -1 (output log-probs only) or a prompt position "
                f"in [0, {len(input_ids)}), got {start!r}"
            )
        if lora_paths[i] == "":
            raise RequestError(f"lora_path{where} is empty; name a loaded adapter, or send null for the base model")
        room = context_length - len(input_ids)
        if room <= 0:
            raise RequestError(
                f"the prompt{where} has {len(input_ids)} tokens but the context length is {context_length}; shorten it"
            )
        if params.max_new_tokens is not None and params.max_new_tokens > room:
            raise RequestError(
                f"sampling_params.max_new_tokens{where}={params.max_new_tokens} plus the {len(input_ids)} prompt tokens "
                f"exceeds the context length {context_length}; lower max_new_tokens to at most {room}"
            )
        window = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in params.stop), default=0)
        requests.append(
            GenerationRequest(
                rid=rids[i],
                input_ids=input_ids,
                params=params,
                return_logprob=bool(return_logprob[i]),
                logprob_start_len=start if return_logprob[i] else -1,
                return_text_in_logprobs=return_text,
                # A couple of extra tokens: a token may decode to half a character.
                stop_str_window=window + 2 if params.stop else 0,
                max_new_tokens=room if params.max_new_tokens is None else params.max_new_tokens,
                return_routed_experts=bool(return_routed[i]),
                lora_path=lora_paths[i],
                vision=visions[i],
            )
        )
    return requests, is_batch


def _parse_image_data(value: Any, count: int, is_batch: bool, vision: Vision | None) -> list[list[Any]]:
    """SGLang's `image_data` as a list of images per prompt: a single prompt takes one image or a list of them, a
    batch one such entry per prompt (null for a prompt without images)."""
    if value in (None, [], ""):
        return [[] for _ in range(count)]
    if vision is None:
        raise RequestError("field 'image_data': this engine serves a text-only model, which takes no images; omit it")
    if not is_batch:
        return [value if isinstance(value, list) else [value]]
    if not isinstance(value, list) or len(value) != count:
        raise RequestError(f"image_data must list one entry (an image, a list of images or null) per prompt ({count})")
    return [[] if item is None else item if isinstance(item, list) else [item] for item in value]


def check_text_fits(text: str, tokenizer, context_length: int, where: str) -> None:
    """Refuse text that cannot fit the context before tokenizing it: it holds at least
    `len(text) / max_token_chars` tokens (15 MiB of text took 54 s and 4.7 GB to tokenize).

    Raises:
        RequestError: naming `where`, its length and the context length.
    """
    per_token = max_token_chars(tokenizer)
    if len(text) > context_length * per_token:
        raise RequestError(
            f"{where} has {len(text)} characters: at least {-(-len(text) // per_token)} tokens (a token here stands "
            f"for at most {per_token} characters), past the context length {context_length}; shorten it"
        )


def _parse_prompts(body: dict, tokenizer, vocab_size: int, context_length: int) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("send exactly one of 'text' and 'input_ids'")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise RequestError("text must be a non-empty string or a non-empty list of non-empty strings")
        for i, t in enumerate(texts):
            check_text_fits(t, tokenizer, context_length, f"text[{i}]" if is_batch else "text")
        return [tokenizer.encode(t) for t in texts], is_batch
    if not isinstance(input_ids, list) or not input_ids:
        raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
    is_batch = isinstance(input_ids[0], list)
    prompts = input_ids if is_batch else [input_ids]
    for i, ids in enumerate(prompts):
        where = f"input_ids[{i}]" if is_batch else "input_ids"
        if not isinstance(ids, list) or not ids:
            raise RequestError(f"{where} must be a non-empty list of token ids")
        bad = [t for t in ids if not (_is_int(t) and 0 <= t < vocab_size)]
        if bad:
            raise RequestError(f"{where} holds {bad[0]!r}, which is not a token id in [0, {vocab_size})")
    return prompts, is_batch


def _per_item(body: dict, name: str, count: int, is_batch: bool, default: Any, kind: type) -> list[Any]:
    """Broadcast a per-request field to `count` items; a batch may instead give one value per prompt."""
    value = body.get(name)
    if value is None:
        return [default] * count
    if is_batch and isinstance(value, list):
        if len(value) != count:
            raise RequestError(
                f"{name} has {len(value)} entries for {count} prompts; give one per prompt or one for all"
            )
        items = value
    else:
        items = [value] * count
    for item in items:
        if item is not None and (not isinstance(item, kind) or (kind is int and isinstance(item, bool))):
            raise RequestError(f"{name} must be {'an object' if kind is dict else kind.__name__}, got {item!r}")
    return [default if item is None else item for item in items]


def _parse_rids(rid: Any, count: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str) and rid:
        return [f"{rid}_{i}" for i in range(count)] if is_batch else [rid]
    if is_batch and isinstance(rid, list) and all(isinstance(r, str) and r for r in rid):
        if len(rid) != count or len(set(rid)) != count:
            raise RequestError(f"rid must list {count} distinct non-empty strings, one per prompt")
        return rid
    raise RequestError(f"rid must be a non-empty string{' or a list of them' if is_batch else ''}, got {rid!r}")


def build_generate_response(request: GenerationRequest, tokenizer) -> dict[str, Any]:
    """The SGLang-shaped /generate answer for a finished request.

    `output_ids` and `output_token_logprobs` hold every generated token, the matched stop token
    included. `text` leaves out the matched stop token / stop string (and what follows the stop
    string) unless `no_stop_trim`, as SGLang does.
    """
    reason = request.finish_reason or {"type": "abort", "message": request.error}
    matched = reason.get("matched") if reason["type"] == "stop" else None
    trim = not request.params.no_stop_trim
    text_ids = request.output_ids[:-1] if trim and _is_int(matched) else request.output_ids
    text = tokenizer.decode(text_ids, skip_special_tokens=request.params.skip_special_tokens)
    if trim and isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]

    meta_info: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": reason,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(request.output_ids),
        "cached_tokens": 0,
        "weight_version": request.weight_version,
        "e2e_latency": (request.finish_time or time.time()) - request.arrival_time,
    }
    if request.return_logprob:

        def token_text(token_id: int) -> str | None:
            return tokenizer.decode([token_id]) if request.return_text_in_logprobs else None

        meta_info["output_token_logprobs"] = [
            [log_prob, token_id, token_text(token_id)]
            for log_prob, token_id in zip(request.output_logprobs, request.output_ids)
        ]
        if request.input_logprobs is not None:
            positions = range(request.logprob_start_len, len(request.input_ids))
            meta_info["input_token_logprobs"] = [
                [request.input_logprobs[pos], request.input_ids[pos], token_text(request.input_ids[pos])]
                for pos in positions
            ]
    if request.return_routed_experts:
        # SGLang's layout: one row per token that went through the model (prompt + output - 1)
        routed = torch.cat(request.routed_experts) if request.routed_experts else torch.zeros(0, dtype=torch.int32)
        meta_info["routed_experts"] = encode_routed_experts(routed)
    return {"text": text, "output_ids": list(request.output_ids), "meta_info": meta_info}
