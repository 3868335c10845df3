"""Micro-batches for the FSDP trainer: which samples go together, and how they are laid out.

Two layouts, both without per-sample padding; the actor picks one from the model's attention kernel:

* **Shared-prompt rows** (sdpa and eager attention, the default). Samples of a micro-batch that
  have the same prompt (GRPO's n samples per prompt) share one row: `[prompt, response_1,
  response_2, ...]`, with an explicit `[rows, 1, L, L]` mask under which every response sees the
  prompt and its own earlier tokens only, and positions that continue from the prompt in every
  response. Each prompt is computed once instead of n times, and attention stays per group
  rather than over the whole micro-batch. Rows are right-padded to the longest. The first token
  of every response is predicted by the prompt's last position, which the responses share.
* **One packed row** (flash attention). The sequences are concatenated and `position_ids` restart
  at 0 at each sequence start; HF turns the restarts into variable-length attention. Under sdpa
  or eager HF would build a dense `N x N` block-diagonal mask over the whole row instead, which
  on CPU costs 3.4x the time of the shared-prompt layout on a GRPO batch (measured, 32 samples
  of SmolLM2-135M, one thread: 34.1 s vs 9.9 s per forward+backward).

In both, the logit at a row position predicts the token at the next position of the same
sequence; `logit_rows` / `logit_positions` say where each response token's predictor sits.
Measured on CPU: logits equal per-sequence logits within 5e-6 (`tests/integration/test_fsdp_backend.py`
checks 1e-5 for both layouts).

Vision-language models (`add_vision_inputs`): the micro-batch also carries its images' `pixel_values` and
`image_grid_thw`, concatenated in the order the images' tokens appear in the rows (a shared prompt's images once),
and `mm_token_type_ids`; `position_ids` become the model's 3-D M-RoPE positions, computed per sequence by the
model's own `get_rope_index`, since a row packing several sequences is beyond the model's own computation. Images may
sit in a response too (a multi-turn sample whose tool turn returned one): a sample's `multimodal_train_inputs` hold
all its images in token order, and a shared-prompt row takes its prompt's images once, then each response's own.

FSDP all-gathers parameters inside every forward, so all data-parallel ranks must run the same
number of forwards: `align_micro_batch_counts` pads short ranks with zero-weight micro-batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from slime.utils.micro_batches import group_samples, plan_step_micro_batches, split_prompt_response, step_slices
from slime.utils.moe_routing import filler_rows, routing_rows

# Attention kernels that take packed sequences through `position_ids` (variable-length attention).
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")


@dataclass
class PackedMicroBatch:
    """A micro-batch's rows and where its response tokens are.

    Attributes:
        sample_indices: Positions of the samples in this rank's rollout shard, in layout order.
        input_ids: `[R, L]` token ids.
        position_ids: `[R, L]` positions within each sequence; for a vision-language model `[3, R, L]` M-RoPE
            positions (`[4, 1, L]` in one packed row: the restarting text positions first, as HF takes them).
        attention_mask: `[R, 1, L, L]` mask for shared-prompt rows (bool, or additive float for eager
            attention), per layer kind (`{"full_attention": ..., "sliding_attention": ...}`) for a model that mixes
            them; None for one packed row, where HF derives the mask from `position_ids`.
        logit_rows: `[M]` the row of each response token's predictor (M = total response length).
        logit_positions: `[M]` the predictor's position in that row.
        target_tokens: `[M]` the response tokens, concatenated in sample order.
        response_lengths: Response length of each sample (splits the `M` axis per sample).
        weight: 1.0, or 0.0 for a padding micro-batch that only keeps collectives aligned.
        sequence_lengths: Tokens of each sequence the forward attends within, padding left out (a sample; or a
            prompt with its responses): what the model FLOPs are counted over.
        routed_experts: `[R, L, num_layers, top_k]` experts to route each position to (MoE routing replay), or None.
        vision_inputs: A vision-language model's extra forward inputs (`mm_token_type_ids`, and `pixel_values` /
            `image_grid_thw` when the rows hold images), or None.
    """

    @property
    def head_tokens(self) -> int:
        """Positions that go through the LM head: every row at each column some response token is predicted from."""
        return self.input_ids.shape[0] * int(torch.unique(self.logit_positions).numel())

    sample_indices: list[int]
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None
    logit_rows: torch.Tensor
    logit_positions: torch.Tensor
    target_tokens: torch.Tensor
    response_lengths: list[int]
    weight: float = 1.0
    sequence_lengths: list[int] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None
    vision_inputs: dict[str, torch.Tensor] | None = None


@dataclass
class VisionBatching:
    """What laying out a vision-language model's micro-batches needs (see `add_vision_inputs`).

    Attributes:
        inputs: Each sample's `multimodal_train_inputs` (`pixel_values`, `image_grid_thw` of all its images, prompt
            and response, in token order), None for one without images.
        rope_index: The model's `get_rope_index(input_ids, mm_token_type_ids=, image_grid_thw=)`.
        image_token_id: The image placeholder token (`config.image_token_id`).
    """

    inputs: list[dict[str, Any] | None]
    rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    image_token_id: int

    def prompt_keys(self, tokens: list[list[int]], response_lengths: list[int]) -> list[bytes | None]:
        """Per sample, a digest of its prompt's images: prompts with equal tokens but other images must not share a
        row (images in the responses do not matter: each response keeps its own)."""
        keys = []
        for index, inputs in enumerate(self.inputs):
            prompt, _ = split_prompt_response(tokens, response_lengths, index)
            count = _image_count(prompt, self.image_token_id)
            if not inputs or not count:
                keys.append(None)
                continue
            images = _images(inputs, 0, count)
            digest = hashlib.sha1(images["pixel_values"].detach().cpu().float().numpy().tobytes())
            digest.update(images["image_grid_thw"].cpu().numpy().tobytes())
            keys.append(digest.digest())
        return keys


def _image_count(ids: list[int], image_token_id: int) -> int:
    """Images in `ids`: each image is one run of its placeholder token (as `expand_image_pads` writes them)."""
    return sum(token == image_token_id and (pos == 0 or ids[pos - 1] != token) for pos, token in enumerate(ids))


def _images(inputs: dict[str, Any], first: int, stop: int | None) -> dict[str, torch.Tensor]:
    """Images `first:stop` of a sample's `multimodal_train_inputs`: their grids and their rows of `pixel_values`
    (t * h * w patches per image)."""
    grid = inputs["image_grid_thw"]
    rows = torch.cumsum(torch.cat([grid.new_zeros(1), grid.prod(dim=-1)]), 0).tolist()
    stop = len(grid) if stop is None else stop
    return {"pixel_values": inputs["pixel_values"][rows[first] : rows[stop]], "image_grid_thw": grid[first:stop]}


def _mrope_positions(ids: list[int], images: dict[str, Any] | None, vision: VisionBatching) -> torch.Tensor:
    """`[3, len(ids)]` M-RoPE positions of one whole sequence whose images are `images` (text positions without)."""
    if not images:
        return torch.arange(len(ids)).expand(3, -1)
    if _image_count(ids, vision.image_token_id) != len(images["image_grid_thw"]):
        raise ValueError(
            f"a sequence holds {_image_count(ids, vision.image_token_id)} runs of the image placeholder token but "
            f"{len(images['image_grid_thw'])} images: the model generated a placeholder itself? A generate function "
            "that posts to the engines by itself must end the response before one, as "
            "slime.utils.router_generate.end_before_generated_image_token does"
        )
    tokens = torch.tensor([ids])
    positions, _ = vision.rope_index(
        tokens, mm_token_type_ids=(tokens == vision.image_token_id).int(), image_grid_thw=images["image_grid_thw"]
    )
    return positions[:, 0]


def add_vision_inputs(
    micro_batch: PackedMicroBatch,
    tokens: list[list[int]],
    response_lengths: list[int],
    vision: VisionBatching,
    prompt_keys: list[bytes | None] | None = None,
) -> None:
    """Give a laid-out micro-batch its M-RoPE `position_ids` and `vision_inputs`, in place.

    Every sequence's positions come from `get_rope_index` over the whole sequence (it places tokens left to right,
    so a prompt's positions do not depend on the response after it). A shared-prompt row holds the prompt once with
    its images (those of the row's first sample), then each response at the positions it has in its own sequence,
    with the images inside it; one packed row gets each sequence's positions and images whole. `prompt_keys` are
    `vision.prompt_keys(tokens, response_lengths)` when the caller has them already.
    """
    device = micro_batch.input_ids.device
    images: list[dict[str, Any]] = []  # in the order their tokens appear in the rows
    if micro_batch.attention_mask is not None:
        positions = micro_batch.position_ids.cpu().expand(3, -1, -1).clone()
        if prompt_keys is None:
            prompt_keys = vision.prompt_keys(tokens, response_lengths)
        for row, members in enumerate(_rows(micro_batch.sample_indices, tokens, response_lengths, prompt_keys)):
            if not any(vision.inputs[i] for i in members):
                continue  # text positions
            first = members[0]
            prompt_length = len(tokens[first]) - response_lengths[first]
            prompt_images = _image_count(tokens[first][:prompt_length], vision.image_token_id)
            start = prompt_length
            for i in members:
                inputs = vision.inputs[i]
                whole = _mrope_positions(tokens[i], inputs, vision)
                if i == first:
                    positions[:, row, :prompt_length] = whole[:, :prompt_length]
                    if inputs and prompt_images:
                        images.append(_images(inputs, 0, prompt_images))
                positions[:, row, start : start + response_lengths[i]] = whole[:, prompt_length:]
                start += response_lengths[i]
                if inputs and len(inputs["image_grid_thw"]) > prompt_images:
                    images.append(_images(inputs, prompt_images, None))
    else:
        parts = []
        for index in micro_batch.sample_indices:
            inputs = vision.inputs[index]
            if inputs:
                images.append(inputs)
            parts.append(_mrope_positions(tokens[index], inputs, vision))
        positions = torch.cat([micro_batch.position_ids.cpu(), torch.cat(parts, dim=1)])[:, None]
    micro_batch.position_ids = positions.to(device)
    extra = {"mm_token_type_ids": (micro_batch.input_ids == vision.image_token_id).int()}
    if images:
        extra["pixel_values"] = torch.cat([inputs["pixel_values"] for inputs in images]).to(device)
        extra["image_grid_thw"] = torch.cat([inputs["image_grid_thw"] for inputs in images]).to(device)
    micro_batch.vision_inputs = extra


def _rows(
    sample_indices: list[int], tokens: list[list[int]], response_lengths: list[int], keys: list[bytes | None]
) -> list[list[int]]:
    """The samples of each shared-prompt row: `pack_shared_prompt_rows` lists a row's samples consecutively."""
    rows: list[list[int]] = []
    previous = None
    for index in sample_indices:
        key = (split_prompt_response(tokens, response_lengths, index)[0], keys[index])
        if key != previous:
            rows.append([])
        rows[-1].append(index)
        previous = key
    return rows


def pack_micro_batch(
    tokens: list[list[int]],
    response_lengths: list[int],
    sample_indices: list[int],
    device: torch.device | str = "cpu",
    weight: float = 1.0,
    routed_experts: list[torch.Tensor] | None = None,
) -> PackedMicroBatch:
    """Concatenate the given samples into one row with restarting positions (variable-length attention).

    Args:
        tokens: Prompt + response token ids of every sample in the shard.
        response_lengths: Response length of every sample in the shard.
        sample_indices: Which samples (shard positions) to pack.
        device: Where the tensors go.
        weight: Loss weight of the micro-batch (0.0 for padding).
        routed_experts: Every sample's engine routing (`Sample.rollout_routed_experts`), to replay; or None.

    Returns:
        The packed micro-batch.
    """
    ids, positions, logit_positions, lengths = [], [], [], []
    for index in sample_indices:
        prompt, response = split_prompt_response(tokens, response_lengths, index)
        start = len(ids) + len(prompt)
        ids.extend(prompt + response)
        positions.extend(range(len(prompt) + len(response)))
        logit_positions.extend(range(start - 1, start + len(response) - 1))
        lengths.append(len(response))
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    logit_positions_tensor = torch.tensor(logit_positions, dtype=torch.long, device=device)
    return PackedMicroBatch(
        sample_indices=list(sample_indices),
        input_ids=input_ids,
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        attention_mask=None,
        logit_rows=torch.zeros_like(logit_positions_tensor),
        logit_positions=logit_positions_tensor,
        target_tokens=input_ids[0, logit_positions_tensor + 1],
        response_lengths=lengths,
        weight=weight,
        sequence_lengths=[len(tokens[index]) for index in sample_indices],
        routed_experts=None
        if routed_experts is None
        else torch.cat([routing_rows(routed_experts[i], len(tokens[i])) for i in sample_indices])[None].to(device),
    )


def pack_shared_prompt_rows(
    tokens: list[list[int]],
    response_lengths: list[int],
    sample_indices: list[int],
    device: torch.device | str = "cpu",
    weight: float = 1.0,
    additive_mask: bool = False,
    routed_experts: list[torch.Tensor] | None = None,
    prompt_keys: list | None = None,
    sliding_window: int | None = None,
) -> PackedMicroBatch:
    """Lay the given samples out as one row per distinct prompt: the prompt once, then its responses.

    Args:
        tokens: Prompt + response token ids of every sample in the shard.
        response_lengths: Response length of every sample in the shard.
        sample_indices: Which samples (shard positions) to lay out.
        device: Where the tensors go.
        weight: Loss weight of the micro-batch (0.0 for padding).
        additive_mask: Give the mask as 0 / -inf floats (eager attention) instead of booleans (sdpa).
        routed_experts: Every sample's engine routing (`Sample.rollout_routed_experts`), to replay; or None. A
            shared prompt takes the routing of its first sample.
        prompt_keys: Per sample, what else two prompts must share to share a row (a vision-language prompt's
            images); None: equal prompt tokens suffice.
        sliding_window: The window of a model that mixes sliding-window and full-attention layers
            (`sliding_window_of`): the mask is then HF's per-kind dict, `{"full_attention": ..., "sliding_attention":
            ...}`, since one mask handed to such a model serves every layer.

    Returns:
        The micro-batch; its `sample_indices` are grouped by prompt, in order of first appearance.
    """
    rows: dict[tuple, list[int]] = {}
    for index in sample_indices:
        prompt, _ = split_prompt_response(tokens, response_lengths, index)
        rows.setdefault((tuple(prompt), prompt_keys and prompt_keys[index]), []).append(index)
    width = max(len(prompt) + sum(response_lengths[i] for i in members) for (prompt, _), members in rows.items())

    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    # segment 0 is the prompt, segment k the k-th response; -1 marks padding
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    routing = None
    if routed_experts is not None:
        _, num_layers, top_k = routed_experts[sample_indices[0]].shape
        routing = filler_rows(len(rows) * width, num_layers, top_k).view(len(rows), width, num_layers, top_k)
    ordered, targets, logit_rows, logit_positions, lengths = [], [], [], [], []
    for row, ((prompt, _), members) in enumerate(rows.items()):
        ids, positions, segment = list(prompt), list(range(len(prompt))), [0] * len(prompt)
        for k, index in enumerate(members, start=1):
            response = tokens[index][len(prompt) :]
            start = len(ids)
            if routing is not None:
                own = routing_rows(routed_experts[index], len(tokens[index]))
                if k == 1:  # the shared prompt takes its first sample's routing
                    routing[row, : len(prompt)] = own[: len(prompt)]
                routing[row, start : start + len(response)] = own[len(prompt) :]
            ids += response
            positions += range(len(prompt), len(prompt) + len(response))
            segment += [k] * len(response)
            # the prompt's last position predicts the first response token, then the response itself
            logit_positions += [len(prompt) - 1, *range(start, start + len(response) - 1)]
            logit_rows += [row] * len(response)
            lengths.append(len(response))
            targets += response
            ordered.append(index)
        input_ids[row, : len(ids)] = torch.tensor(ids)
        position_ids[row, : len(ids)] = torch.tensor(positions)
        segments[row, : len(ids)] = torch.tensor(segment)

    query, key = segments[:, :, None], segments[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (query >= 0) & ((key == 0) | (key == query))
    itself = torch.eye(width, dtype=torch.bool)  # padding positions see themselves: no all-masked softmax rows
    masks = {"full_attention": allowed | itself}
    if sliding_window is not None:  # HF's rule: a query sees keys fewer than `sliding_window` positions back
        near = position_ids[:, :, None] - position_ids[:, None, :] < sliding_window
        masks["sliding_attention"] = (allowed & near) | itself
    for kind, allowed_kind in masks.items():
        masks[kind] = allowed_kind[:, None].to(device)
        if additive_mask:
            masks[kind] = torch.zeros(masks[kind].shape, device=device).masked_fill_(
                ~masks[kind], torch.finfo(torch.float32).min
            )

    return PackedMicroBatch(
        sample_indices=ordered,
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=masks if sliding_window is not None else masks["full_attention"],
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        logit_positions=torch.tensor(logit_positions, dtype=torch.long, device=device),
        target_tokens=torch.tensor(targets, dtype=torch.long, device=device),
        response_lengths=lengths,
        weight=weight,
        sequence_lengths=[
            len(prompt) + sum(response_lengths[i] for i in members) for (prompt, _), members in rows.items()
        ],
        routed_experts=None if routing is None else routing.to(device),
    )


def plan_shared_prompt_micro_batches(
    tokens: list[list[int]],
    response_lengths: list[int],
    num_steps: int,
    max_tokens: int,
    prompt_keys: list | None = None,
) -> list[list[list[int]]]:
    """The micro-batches of every step for shared-prompt rows under a token budget (dynamic batch size).

    Samples with the same prompt are kept together and cost their prompt once: units of one prompt
    plus as many of its responses as fit in `max_tokens`, packed first-fit decreasing.

    Args:
        prompt_keys: As in `pack_shared_prompt_rows`.

    Returns:
        For each step, lists of shard positions, one per micro-batch.
    """
    plan = []
    for block in step_slices(len(tokens), num_steps):
        units: list[list[int]] = []
        costs: list[int] = []
        open_unit: dict[tuple, int] = {}  # prompt -> index of its unit that still takes samples
        for index in block:
            prompt, response = split_prompt_response(tokens, response_lengths, index)
            key = (tuple(prompt), prompt_keys and prompt_keys[index])
            unit = open_unit.get(key)
            if unit is None or costs[unit] + len(response) > max_tokens:
                unit = len(units)
                units.append([])
                costs.append(len(prompt))
                open_unit[key] = unit
            units[unit].append(index)
            costs[unit] += len(response)
        bins = group_samples(list(range(len(units))), costs, max_tokens=max_tokens)
        plan.append([sorted(index for unit in bin_ for index in units[unit]) for bin_ in bins])
    return plan


def align_micro_batch_counts(groups: list[list[int]], process_group: dist.ProcessGroup | None = None) -> int:
    """How many micro-batches every rank must run: the largest count over the data-parallel ranks.

    Args:
        groups: This rank's micro-batches of one step.
        process_group: The data-parallel group (default group when None).

    Returns:
        The common micro-batch count; ranks with fewer add zero-weight copies of a micro-batch.
    """
    count = torch.tensor([len(groups)], dtype=torch.long)
    if dist.is_available() and dist.is_initialized():
        count = count.to(_collective_device(process_group))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=process_group)
    return int(count.item())


def sliding_window_of(config) -> int | None:
    """The window of a model whose layers mix sliding-window and full attention (`layer_types`: gpt-oss, Gemma,
    ...); None otherwise."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "sliding_attention" in (getattr(text, "layer_types", None) or []):
        return int(text.sliding_window)
    return None


def build_step_micro_batches(
    tokens: list[list[int]],
    response_lengths: list[int],
    num_steps: int,
    micro_batch_size: int | None,
    max_tokens: int | None,
    device: torch.device | str = "cpu",
    process_group: dist.ProcessGroup | None = None,
    attn_implementation: str = "sdpa",
    routed_experts: list[torch.Tensor] | None = None,
    vision: VisionBatching | None = None,
    sliding_window: int | None = None,
    one_sample_rows: bool = False,
) -> list[list[PackedMicroBatch]]:
    """Micro-batches of every optimizer step of this rank's shard, aligned across ranks.

    Args:
        tokens: Prompt + response token ids of each sample of the shard.
        response_lengths: Response length of each sample.
        num_steps: Optimizer steps in the rollout.
        micro_batch_size: Samples per micro-batch when `max_tokens` is None.
        max_tokens: Token budget per micro-batch (dynamic batch size), or None.
        device: Where the tensors go.
        process_group: The data-parallel group used to align micro-batch counts.
        attn_implementation: The model's `config._attn_implementation`; picks the layout (module docstring).
        routed_experts: Each sample's engine routing, laid out with the tokens for routing replay; or None.
        vision: A vision-language model's images and M-RoPE (`add_vision_inputs`); None for a text-only model.
        sliding_window: `sliding_window_of` the model's config (shared-prompt rows mask sliding-window layers).
        one_sample_rows: Each sample alone in its own micro-batch and row, without a mask: the forward an engine
            runs over one sequence (`--true-on-policy-mode`); `micro_batch_size` and `max_tokens` are then unused.

    Returns:
        For each step, its micro-batches; padding ones (weight 0) repeat the step's first micro-batch.
    """
    shared = attn_implementation not in VARLEN_ATTENTION and not one_sample_rows
    if one_sample_rows:
        micro_batch_size, max_tokens = 1, None
    additive = attn_implementation == "eager"
    prompt_keys = vision.prompt_keys(tokens, response_lengths) if vision is not None and shared else None

    def layout(group: list[int], weight: float = 1.0) -> PackedMicroBatch:
        if not shared:
            micro_batch = pack_micro_batch(tokens, response_lengths, group, device, weight, routed_experts)
        else:
            micro_batch = pack_shared_prompt_rows(
                tokens,
                response_lengths,
                group,
                device,
                weight,
                additive_mask=additive,
                routed_experts=routed_experts,
                prompt_keys=prompt_keys,
                sliding_window=sliding_window,
            )
        if vision is not None:
            add_vision_inputs(micro_batch, tokens, response_lengths, vision, prompt_keys)
        return micro_batch

    if shared and max_tokens is not None:
        plan = plan_shared_prompt_micro_batches(tokens, response_lengths, num_steps, max_tokens, prompt_keys)
    else:
        plan = plan_step_micro_batches(tokens, num_steps, micro_batch_size, max_tokens)
    steps = []
    for groups in plan:
        target = align_micro_batch_counts(groups, process_group)
        micro_batches = [layout(group) for group in groups]
        micro_batches += [layout(groups[0], weight=0.0) for _ in range(target - len(groups))]
        steps.append(micro_batches)
    return steps


def _collective_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """CPU for gloo, the current CUDA device for NCCL."""
    backend = dist.get_backend(process_group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
