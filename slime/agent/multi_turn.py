"""Building blocks for hand-written multi-turn generate functions (`--custom-generate-function-path`).

A multi-turn sample is one token sequence: the prompt, then model turns (loss mask 1, with the engine's
log-probs) interleaved with tool or environment observations (loss mask 0, log-prob 0). Every turn sends
`sample.tokens` to the router as `input_ids`, so the trainer sees exactly the tokens the engine saw and no
re-tokenization can move a turn boundary.

    async def generate(args, sample, sampling_params):
        episode = start_episode(args, sample)
        while not episode.done:
            text = await model_turn(args, episode, sampling_params)
            query = extract_tag(text, "search")
            if query is None or episode.done:
                break
            append_observation(episode, f"<information>{search(query)}</information>")
        return episode.sample

Vision-language models: the prompt's images (`sample.multimodal_inputs["images"]`) and any an observation brings
(`append_observation(..., images=...)`, or image parts of `append_messages`) have their placeholders expanded to
their visual tokens; every request sends all the images so far as `image_data`, and
`sample.multimodal_train_inputs` holds them all in token order for the trainer.

Budgets: the context (`--rollout-max-context-len`, else what the engine holds) caps prompt, turns and
observations together. A turn's `max_new_tokens` is clipped to the room left, an observation that does not
fit is cut and ends the sample TRUNCATED, and `--max-turns` caps the model turns (`Episode.done`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from slime.agent.chat_turns import continuation_ids, message_images
from slime.utils import misc
from slime.utils.data import VisionPrompter, load_vision_prompter
from slime.utils.engine_args import context_limit
from slime.utils.processing_utils import load_image
from slime.utils.router_generate import generate_into_sample
from slime.utils.tool_calls import parse_tool_calls
from slime.utils.types import Sample, Status

# A sample in one of these states takes no further turn.
_ENDED = (Status.TRUNCATED, Status.ABORTED, Status.FAILED)


@dataclass
class Episode:
    """A multi-turn sample being generated.

    Args:
        sample: The sample; its `tokens`, `response`, `loss_mask` and `rollout_log_probs` grow with each turn.
        tokenizer: Tokenizes observations (the checkpoint's own tokenizer).
        context_limit: Most prompt + response tokens the sample may reach.
        max_turns: Most model turns (`--max-turns`).
        turns: Model turns taken so far.
        vision: The checkpoint's image side (`load_vision`); None for a text-only model, which takes no images.
    """

    sample: Sample
    tokenizer: Any
    context_limit: int
    max_turns: int
    turns: int = 0
    vision: VisionPrompter | None = None

    @property
    def room(self) -> int:
        """Tokens the context still holds."""
        return self.context_limit - len(self.sample.tokens)

    @property
    def done(self) -> bool:
        """No further model turn: the turns are spent, the context is full, or the sample was truncated or aborted."""
        return self.turns >= self.max_turns or self.room <= 0 or self.sample.status in _ENDED


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer of `path` (`--hf-checkpoint`), loaded once per process (its own code runs only under
    `--trust-remote-code`)."""
    return misc.load_tokenizer(path, trust_remote_code)


@functools.lru_cache(maxsize=4)
def load_vision(path: str, trust_remote_code: bool = False) -> VisionPrompter | None:
    """The image side of `path` (`--hf-checkpoint`), loaded once per process; None for a text-only model."""
    return load_vision_prompter(path, trust_remote_code)


def start_episode(args, sample: Sample, tokenizer: Any = None) -> Episode:
    """Tokenize the prompt into `sample.tokens` and start a multi-turn episode on it.

    A prompt with images (`sample.multimodal_inputs["images"]`, one placeholder each in the templated prompt) gets
    its placeholders expanded and its `multimodal_train_inputs`. A sample generated before (it has a response or
    trainer inputs) drops the images its observations added, after the prompt's.

    A sample that comes back with a partial response (`--partial-rollout`) starts over from its prompt: the turn
    structure of what it had is not known here.

    Args:
        args: Parsed slime arguments (reads `hf_checkpoint`, `max_turns`, the context flags).
        sample: Its `prompt` is text (already templated) or chat messages (templated here).
        tokenizer: Defaults to `--hf-checkpoint`'s.

    Raises:
        ValueError: The prompt leaves no room for a response in the context, or it has images and the model is
            text-only.
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.hf_checkpoint, args.trust_remote_code)
    vision = load_vision(args.hf_checkpoint, args.trust_remote_code)
    prompt = sample.prompt
    if isinstance(prompt, list):
        prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    sample.tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    images = (sample.multimodal_inputs or {}).get("images") or []
    if images and vision is None:
        raise ValueError(f"sample {sample.index} has images but {args.hf_checkpoint} is a text-only model")
    if images and (sample.response_length or sample.multimodal_train_inputs is not None):  # generated before
        images = images[: len(_image_runs(sample.tokens, vision.image_token_id))]
    sample.response, sample.response_length, sample.loss_mask, sample.rollout_log_probs = "", 0, [], []
    sample.weight_versions, sample.status, sample.rollout_routed_experts = [], Status.PENDING, None
    sample.multimodal_train_inputs = None
    if images:
        sample.tokens, sample.multimodal_train_inputs = vision.prepare(sample.tokens, images)
        sample.multimodal_inputs = {**sample.multimodal_inputs, "images": list(images)}
    episode = Episode(sample, tokenizer, context_limit(args), args.max_turns, vision=vision)
    if episode.room <= 0:
        raise ValueError(
            f"sample {sample.index}: the prompt has {len(sample.tokens)} tokens, which leaves no room for a response "
            f"in the context limit of {episode.context_limit} tokens; drop long prompts with --rollout-max-prompt-len "
            "or raise --rollout-max-context-len / --sglang-context-length"
        )
    return episode


async def model_turn(args, episode: Episode, sampling_params: dict[str, Any]) -> str:
    """Generate one model turn through the router and append it (loss mask 1, with its log-probs).

    `max_new_tokens` is clipped to the room left in the context. The sample's status becomes the turn's finish:
    COMPLETED (EOS or a stop string, which stays in the text with the default `no_stop_trim`), TRUNCATED (the
    turn ran out of tokens: the episode is done) or ABORTED.

    Returns:
        The turn's text ("" when the context was already full).
    """
    sample = episode.sample
    params = dict(sampling_params)
    params["max_new_tokens"] = min(params.get("max_new_tokens", episode.room), episode.room)
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return ""
    text = await generate_into_sample(args, sample, params)
    episode.turns += 1
    return text


def append_observation(episode: Episode, text: str, images: list[Any] | None = None) -> bool:
    """Append tool or environment output (loss mask 0): the model reads it but is not trained on it.

    Args:
        text: The observation, with one image placeholder per image where it goes (the chat template's, e.g.
            `<|vision_start|><|image_pad|><|vision_end|>` for Qwen-VL).
        images: Images the observation shows (what `load_image` takes: PIL images, paths, base64, data URLs), for a
            vision-language model. Their placeholders are expanded to their visual tokens; they join
            `sample.multimodal_inputs["images"]` (sent with every later turn) and `sample.multimodal_train_inputs`.

    Returns:
        True when it fits with room left for another turn. Otherwise it is cut to what the context holds (before an
        image that does not fit whole, which is left out), the sample becomes TRUNCATED and False comes back.

    Raises:
        ValueError: images for a text-only model, an unreadable image, or placeholders that do not match the images.
    """
    ids = episode.tokenizer(text, add_special_tokens=False)["input_ids"]
    return _append_context(episode, ids, text, images or [])


def append_messages(episode: Episode, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> bool:
    """Append chat messages after the last model turn (tool results, a user turn) as the chat template writes them
    there: the turn's terminator if the model did not sample it, the messages, the next generation prompt (loss
    mask 0; see `slime.agent.chat_turns.continuation_ids`).

    Message content may hold image parts (`{"type": "image_url", "image_url": {"url": ...}}` or `{"type": "image",
    "image": ...}`) on a vision-language model: they become the model's placeholders, expanded as in
    `append_observation`.

    Returns:
        As `append_observation`.
    """
    sample = episode.sample
    sampled = sample.tokens[len(sample.tokens) - sample.response_length :]
    ids = continuation_ids(episode.tokenizer, sampled, messages, tools)
    images = [image for _, image in message_images(messages)]
    return _append_context(episode, ids, episode.tokenizer.decode(ids), images)


def _append_context(episode: Episode, ids: list[int], text: str, images: list[Any]) -> bool:
    """Append `ids` (`text`, with one placeholder per image of `images`) as context: see `append_observation`."""
    sample = episode.sample
    inputs = None
    if images:
        if episode.vision is None:
            raise ValueError(f"sample {sample.index}: an observation has images but the model is text-only")
        # Environment code is the user's own: its image paths may be read (HTTP clients' never are).
        images = [load_image(image, f"observation image {i}", allow_path=True) for i, image in enumerate(images)]
        try:
            ids, inputs = episode.vision.prepare(ids, images)
        except ValueError as error:
            raise ValueError(f"sample {sample.index}: the observation does not place its images: {error}") from None
    fits = len(ids) < episode.room
    if not fits:
        cut = max(episode.room, 0)
        if images:  # keep the images whose placeholders fit whole; cut before the first that does not
            runs = _image_runs(ids, episode.vision.image_token_id)
            kept = sum(end <= cut for _, end in runs)
            if kept < len(runs):
                cut = min(cut, runs[kept][0])
            images = images[:kept]
            inputs = _first_images(inputs, kept)
        ids = ids[:cut]
        text = episode.tokenizer.decode(ids)
    sample.append_response(ids, text, None, trainable=False)
    if images:
        sample.multimodal_inputs = {
            **(sample.multimodal_inputs or {}),
            "images": [*(sample.multimodal_inputs or {}).get("images", []), *images],
        }
        sample.multimodal_train_inputs = _concat_images(sample.multimodal_train_inputs, inputs)
    if not fits:
        sample.status = Status.TRUNCATED
    return fits


def _image_runs(ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of the image placeholder token: one per image."""
    runs: list[tuple[int, int]] = []
    for pos, token in enumerate(ids):
        if token == image_token_id:
            if runs and runs[-1][1] == pos:
                runs[-1] = (runs[-1][0], pos + 1)
            else:
                runs.append((pos, pos + 1))
    return runs


def _first_images(inputs: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    grid = inputs["image_grid_thw"][:count]
    return {"pixel_values": inputs["pixel_values"][: int(grid.prod(dim=-1).sum())], "image_grid_thw": grid}


def _concat_images(old: dict[str, torch.Tensor] | None, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's image inputs of `old`'s images followed by `new`'s (`pixel_values` rows, `image_grid_thw`)."""
    if not old:
        return new
    return {key: torch.cat([old[key], new[key]]) for key in ("pixel_values", "image_grid_thw")}


def extract_tag(text: str, tag: str) -> str | None:
    """The stripped body of the last complete `<tag>...</tag>` in `text`, or None."""
    bodies = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, re.DOTALL)
    return bodies[-1].strip() if bodies else None


def first_tool_call(text: str, names: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """The first Hermes `<tool_call>` in `text` to a tool in `names`, as (name, arguments), or None.

    Parsed by `slime.utils.tool_calls`, as the OpenAI endpoint parses them.
    """
    _, calls = parse_tool_calls(text)
    for call in calls:
        if call.name in names:
            return call.name, json.loads(call.arguments)
    return None
