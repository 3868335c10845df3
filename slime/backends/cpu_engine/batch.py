"""The tensors of a running batch and the model calls on them: prefill, decode, merge, shrink.

Sequences are left-padded into one KV cache (transformers' `DynamicCache`). Every row keeps
its own position counter, so a row's RoPE positions never include padding, and an attention
mask hides the padded cache columns. New sequences join a running batch by prefilling them
on their own and concatenating the two caches along the batch axis after left-padding the
shorter one (continuous batching); finished rows are dropped with `batch_select_indices`.

Vision-language rows carry their images (`GenerationRequest.vision`): their pixels go into the prefill forward and
their 3-D M-RoPE positions replace the plain counter there; after the prompt, every axis advances by one per token
from the row's `next_position`, so decode needs nothing special.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from slime.algorithms.logprobs import compute_log_probs
from slime.backends.cpu_engine.lora import LoraStore
from slime.backends.cpu_engine.protocol import GenerationRequest
from slime.backends.cpu_engine.vision import VisionInputs
from slime.utils.moe_routing import HFRouters

# Dropping all-padding cache columns costs a copy; only do it once this many pile up.
_TRIM_MIN_COLUMNS = 64


class _RoomyLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with spare columns: a decode step writes its
    column into them instead of copying the whole cache into a new tensor (`torch.cat`, 17 ms of a 128 ms step for
    32 rows of SmolLM2-135M). Values are the same; only where they live differs."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys = _append_columns(self.keys, key_states)
        self.values = _append_columns(self.values, value_states)
        return self.keys, self.values


def _append_columns(cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`torch.cat([cached, new], dim=-2)` for (rows, heads, columns, dim) tensors, written into the spare columns of
    the buffer `cached` views when it has them; otherwise into a new buffer with a quarter more room (at least 64
    columns), so a sequence of n tokens costs O(log n) whole copies."""
    rows, heads, columns, dim = cached.shape
    width = columns + new.shape[-2]
    room = cached.stride(1) // dim
    in_place = cached.storage_offset() == 0 and cached.stride() == (heads * room * dim, room * dim, dim, 1)
    if in_place and room >= width:
        grown = cached.as_strided((rows, heads, width, dim), cached.stride())
    else:
        grown = cached.new_empty(rows, heads, width + max(64, width // 4), dim)[:, :, :width]
        grown[:, :, :columns] = cached
    grown[:, :, columns:] = new
    return grown


def _with_room(cache: DynamicCache) -> DynamicCache:
    """`cache` with its plain key/value layers appending in place (`_RoomyLayer`); other kinds stay as they are."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = _RoomyLayer
    return cache


@dataclass
class RunningBatch:
    """Sequences decoding together.

    Args:
        requests: One per row.
        cache: KV cache, (rows, heads, columns, head_dim) per layer.
        attention_mask: (rows, columns); 0 marks padding columns.
        next_positions: (rows,) position id of the token each row feeds next.
        last_tokens: (rows,) the token each row feeds next (its newest sampled token).
    """

    requests: list[GenerationRequest]
    cache: DynamicCache
    attention_mask: torch.Tensor
    next_positions: torch.Tensor
    last_tokens: torch.Tensor

    def __len__(self) -> int:
        return len(self.requests)


@functools.cache
def _cache_argument(model_class: type) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use whichever the model takes."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _adapters(lora: LoraStore | None, names: list[str | None]) -> contextlib.AbstractContextManager:
    """Apply each row's LoRA adapter (`names[row]`, None for the base model) to the forwards in the block."""
    return lora.rows(names) if lora is not None else contextlib.nullcontext()


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids, attention_mask), both (len(sequences), longest)."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, longest - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, longest - len(seq) :] = 1
    return ids, mask


@torch.no_grad()
def prefill(
    model,
    requests: list[GenerationRequest],
    pad_id: int,
    routers: HFRouters | None = None,
    lora: LoraStore | None = None,
) -> tuple[RunningBatch, torch.Tensor]:
    """Run the prompts of `requests` through the model in one left-padded forward.

    Identical prompts of the same adapter (GRPO's n samples of one prompt arrive together) are computed
    once and their cache rows copied, so prefill costs one pass per distinct prompt. With `routers`, requests
    that asked for it get their prompt's routed experts appended to `routed_experts`. With `lora`, each row
    gets its request's adapter (`lora_path`).

    Returns:
        (batch, logits): `batch.last_tokens` is still unset (zeros) until the caller samples from
        `logits`, the (rows, vocab) next-token logits of every prompt.
    """
    distinct: dict[tuple[str | None, tuple[int, ...], bytes | None], int] = {}
    firsts: list[GenerationRequest] = []  # the request behind each distinct row
    rows = []
    for r in requests:
        key = (r.lora_path, tuple(r.input_ids), r.vision.key if r.vision is not None else None)
        if key not in distinct:
            distinct[key] = len(distinct)
            firsts.append(r)
        rows.append(distinct[key])
    source_rows = torch.tensor(rows)
    ids, mask = left_pad([list(r.input_ids) for r in firsts], pad_id)
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    images = _image_inputs(firsts, positions)
    cache = _with_room(DynamicCache(config=model.config))
    # The model fills `cache` in place.
    with _adapters(lora, [r.lora_path for r in firsts]):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{"position_ids": positions, **images, _cache_argument(type(model)): cache},
        )
    logits = out.logits[:, -1, :]
    if routers is not None and any(r.return_routed_experts for r in requests):
        routed = routers.take()
        routed = routed.view(ids.shape[0], ids.shape[1], *routed.shape[1:])
        for request, row in zip(requests, source_rows.tolist()):
            if request.return_routed_experts:  # the prompt sits at the row's end (left padding)
                request.routed_experts.append(routed[row, ids.shape[1] - len(request.input_ids) :].clone())
    if len(distinct) < len(requests):
        cache.batch_select_indices(source_rows)
        mask, logits = mask[source_rows], logits[source_rows]
    batch = RunningBatch(
        requests=list(requests),
        cache=cache,
        attention_mask=mask,
        next_positions=torch.tensor([_next_position(r) for r in requests]),
        last_tokens=torch.zeros(len(requests), dtype=torch.long),
    )
    return batch, logits


def _next_position(request: GenerationRequest) -> int:
    return request.vision.next_position if request.vision is not None else len(request.input_ids)


def _image_inputs(requests: list[GenerationRequest], positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The image keyword arguments of a left-padded prefill of `requests` ({} when none has images).

    `positions` (rows, columns) becomes (3, rows, columns): text rows repeat their counter on the three M-RoPE
    axes, image rows take their own positions; pixels are concatenated in row order, as the model scatters image
    features into the placeholders of the flattened batch.
    """
    with_images: list[VisionInputs] = [r.vision for r in requests if r.vision is not None]
    if not with_images:
        return {}
    positions = positions.unsqueeze(0).repeat(3, 1, 1)
    for row, request in enumerate(requests):
        if request.vision is not None:
            positions[:, row, positions.shape[-1] - len(request.input_ids) :] = request.vision.position_ids
    return {
        "position_ids": positions,
        "pixel_values": torch.cat([v.pixel_values for v in with_images]),
        "image_grid_thw": torch.cat([v.image_grid_thw for v in with_images]),
    }


@torch.no_grad()
def decode(model, batch: RunningBatch, routers: HFRouters | None = None, lora: LoraStore | None = None) -> torch.Tensor:
    """Feed every row's last token, extend the cache by one column, return (rows, vocab) logits.

    With `routers`, requests that asked for it get the fed token's routed experts appended to `routed_experts`.
    With `lora`, each row gets its request's adapter.
    """
    mask = torch.cat([batch.attention_mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=-1)
    with _adapters(lora, [r.lora_path for r in batch.requests]):
        out = model(
            input_ids=batch.last_tokens.unsqueeze(-1),
            attention_mask=mask,
            position_ids=batch.next_positions.unsqueeze(-1),
            use_cache=True,
            **{_cache_argument(type(model)): batch.cache},
        )
    batch.attention_mask = mask
    batch.next_positions = batch.next_positions + 1
    if routers is not None and any(r.return_routed_experts for r in batch.requests):
        routed = routers.take()
        for row, request in enumerate(batch.requests):
            if request.return_routed_experts:
                request.routed_experts.append(routed[row : row + 1].clone())
    return out.logits[:, -1, :]


@torch.no_grad()
def prompt_log_probs(
    model,
    input_ids: list[int],
    start: int,
    temperature: float,
    lora: LoraStore | None = None,
    adapter: str | None = None,
    vision: VisionInputs | None = None,
) -> list[float | None]:
    """Log-probs of prompt tokens given their prefix, for positions >= `start` (None elsewhere and at 0).

    Run on its own (batch of one) so the full (length, vocab) logits of only one prompt are alive. `adapter`
    names the LoRA adapter of `lora` to apply (None: the base model); `vision` holds the prompt's images.
    """
    images = {}
    if vision is not None:
        images = {
            "position_ids": vision.position_ids.unsqueeze(1),
            "pixel_values": vision.pixel_values,
            "image_grid_thw": vision.image_grid_thw,
        }
    with _adapters(lora, [adapter]):
        logits = model(input_ids=torch.tensor([input_ids]), use_cache=False, **images).logits[0, :-1].float()
    scale = temperature if temperature > 0 else 1.0
    log_probs = (logits / scale).log_softmax(dim=-1)
    picked = log_probs.gather(-1, torch.tensor(input_ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
    return [None] + [lp if pos + 1 >= start else None for pos, lp in enumerate(picked)]


def response_log_probs(model, prompt_ids: list[int], output_ids: list[int], temperature: float) -> list[float]:
    """Log-probs of `output_ids` after `prompt_ids` computed as the FSDP trainer computes them for a row holding one
    sample (`fsdp_utils.model.response_logits`, then `compute_log_probs`): the same forward and the same float32 ops,
    so on the same thread count the same bits (`--true-on-policy-mode`)."""
    tokens = torch.tensor([prompt_ids + output_ids])
    columns = torch.arange(len(prompt_ids) - 1, tokens.shape[1] - 1)
    with torch.no_grad():
        output = model(
            input_ids=tokens, position_ids=torch.arange(tokens.shape[1])[None], use_cache=False, logits_to_keep=columns
        )
    logits = output.logits[0].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return compute_log_probs(logits, torch.tensor(output_ids)).tolist()


def caches_can_merge(cache: DynamicCache) -> bool:
    """Only full-attention key/value layers can be left-padded: a sliding window moves, a linear-attention layer
    (Qwen3-Next, Qwen3.5) keeps a recurrent state instead of keys and values, and a DSA layer (DeepSeek-V3.2, GLM-5)
    keeps its indexer's keys beside them, which a merge of keys and values would drop."""
    return all(
        getattr(layer, "is_sliding", True) is False and not hasattr(layer, "indexer_keys") for layer in cache.layers
    )


def _layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_columns(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """Left-pad dim -2 of a (rows, heads, cols, dim) cache tensor, or the last dim of a 2-D mask."""
    if columns == 0:
        return tensor
    if tensor.dim() == 2:
        return torch.cat([tensor.new_zeros(tensor.shape[0], columns), tensor], dim=-1)
    pad = tensor.new_zeros(tensor.shape[0], tensor.shape[1], columns, tensor.shape[3])
    return torch.cat([pad, tensor], dim=-2)


def merge(model, running: RunningBatch, joining: RunningBatch) -> RunningBatch:
    """One batch holding the rows of `running` then `joining`; the shorter cache is left-padded."""
    width = max(running.attention_mask.shape[1], joining.attention_mask.shape[1])
    pad_a = width - running.attention_mask.shape[1]
    pad_b = width - joining.attention_mask.shape[1]
    layers = [
        (
            torch.cat([_pad_columns(ka, pad_a), _pad_columns(kb, pad_b)]),
            torch.cat([_pad_columns(va, pad_a), _pad_columns(vb, pad_b)]),
        )
        for (ka, va), (kb, vb) in zip(_layer_tensors(running.cache), _layer_tensors(joining.cache))
    ]
    return RunningBatch(
        requests=running.requests + joining.requests,
        cache=_with_room(DynamicCache(layers, config=model.config)),
        attention_mask=torch.cat(
            [_pad_columns(running.attention_mask, pad_a), _pad_columns(joining.attention_mask, pad_b)]
        ),
        next_positions=torch.cat([running.next_positions, joining.next_positions]),
        last_tokens=torch.cat([running.last_tokens, joining.last_tokens]),
    )


def keep_rows(model, batch: RunningBatch, rows: list[int]) -> RunningBatch:
    """Drop every row not in `rows`; also drop leading cache columns that became padding for all rows."""
    index = torch.tensor(rows, dtype=torch.long)
    batch.cache.batch_select_indices(index)
    mask = batch.attention_mask[index]
    batch = RunningBatch(
        requests=[batch.requests[row] for row in rows],
        cache=batch.cache,
        attention_mask=mask,
        next_positions=batch.next_positions[index],
        last_tokens=batch.last_tokens[index],
    )
    empty_columns = int(mask.any(dim=0).long().argmax()) if mask.numel() else 0
    if empty_columns >= _TRIM_MIN_COLUMNS and caches_can_merge(batch.cache):
        layers = [(k[:, :, empty_columns:], v[:, :, empty_columns:]) for k, v in _layer_tensors(batch.cache)]
        batch.cache = _with_room(DynamicCache(layers, config=model.config))
        batch.attention_mask = mask[:, empty_columns:]
    return batch
