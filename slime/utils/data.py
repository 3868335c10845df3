"""Prompt datasets: read JSONL / Parquet records and turn them into prompt `Sample`s.

A prompt file is small next to a model, so everything stays in memory. Each record becomes one
`Sample` holding the prompt (text, or chat messages), the label and the metadata; the rollout
fills in tokens and the response later.

Vision-language prompts (`--multimodal-keys '{"image": "images"}'`): a record's images are read once, here, and kept
as RGB PIL images in `Sample.multimodal_inputs["images"]`; the prompt's messages get one image part per image, which
the chat template turns into the model's placeholder. `VisionPrompter` turns a prompt's token ids and images into
what the engines and the trainer see (expanded placeholders, `pixel_values`, `image_grid_thw`).
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from slime.utils.misc import load_pretrained
from slime.utils.processing_utils import (
    expand_image_pads,
    image_token_counts,
    is_vision_language,
    load_image,
    load_image_processor,
)
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
# Upstream's marker in prompt text for "the next image here".
IMAGE_PLACEHOLDER = "<image>"


def iter_records(path: str, flag: str = "--prompt-data") -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield `(location, record)` pairs from a JSONL or Parquet file.

    Args:
        path: A `.jsonl` / `.json` file with one JSON object per line (blank lines are skipped),
            or a `.parquet` file.
        flag: The command-line flag that named `path`, quoted in error messages.

    Returns:
        An iterator of pairs; `location` is "line N" (JSONL) or "row N" (Parquet), 1-based,
        for error messages about a single record.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file '{path}' (from {flag}) does not exist; check the path passed to {flag}")
    if path.endswith(JSONL_SUFFIXES):
        yield from _iter_jsonl(path)
    elif path.endswith(PARQUET_SUFFIXES):
        import pyarrow.parquet as pq

        for row_number, record in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"row {row_number}", record
    else:
        supported = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
        raise ValueError(f"data file '{path}' (from {flag}) has an unsupported extension; supported: {supported}")


def _iter_jsonl(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                snippet = line.strip()[:80]
                raise ValueError(
                    f"{path}, line {line_number}: not valid JSON ({e.msg}): {snippet!r}. "
                    "The file must hold one JSON object per line."
                ) from e
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}, line {line_number}: expected a JSON object, got {type(record).__name__}. "
                    "The file must hold one JSON object per line."
                )
            yield f"line {line_number}", record


def read_records(path: str, flag: str = "--prompt-data") -> list[dict[str, Any]]:
    """Read every record of a JSONL or Parquet file (see `iter_records`).

    Args:
        path: The data file.
        flag: The command-line flag that named `path`, quoted in error messages.

    Returns:
        The records, in file order.
    """
    return [record for _, record in iter_records(path, flag)]


def read_file(path: str) -> Iterator[dict[str, Any]]:
    """Upstream slime's record reader: yield each record (a dict) of a JSONL or Parquet file, in file order.

    Errors are those of `iter_records` (missing file, unsupported extension, a line that is not a JSON object).
    """
    for _, record in iter_records(path, flag="read_file"):
        yield record


def _maybe_parse_json(value: Any, what: str, where: str) -> Any:
    """Columns such as metadata or tools are often stored as JSON strings (Parquet has no free-form dicts)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: {what} is a string but not valid JSON ({e.msg}): {value[:80]!r}") from e


def read_images(value: Any, where: str, base_dir: str = ".") -> list[Image.Image]:
    """A record's images as RGB PIL images.

    Args:
        value: One image or a list of them; each a path (relative to `base_dir` or absolute), base64 text, a
            `data:` URL, raw bytes, a PIL image, or a Parquet image cell (`{"bytes": ..., "path": ...}`, how HF
            `datasets` stores its Image feature).
        where: How errors name the value (file, record, key).
        base_dir: Folder that relative paths are read from (the data file's).

    Raises:
        ValueError: naming `where[i]` for an image that cannot be read (missing file, not an image, a web URL).
    """
    items = list(value) if isinstance(value, list | tuple) else [value]
    images = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, str) and not item.startswith(("data:", "http://", "https://")):
            local = os.path.join(base_dir, os.path.expanduser(item))
            if len(item) < 4096 and os.path.isfile(local):
                item = local
        images.append(load_image(item, f"{where}[{i}]", allow_path=True))  # the run's own data files: trusted
    return images


def _with_image_parts(messages: list[dict[str, Any]], num_images: int, where: str) -> list[dict[str, Any]]:
    """Copies of `messages` with one `{"type": "image"}` part per image: each "<image>" in a text content becomes
    one; with none anywhere, the images go before the text of the first user message."""
    messages = [dict(m) for m in messages]
    found = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            parts: list[dict[str, Any]] = []
            for i, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if i:
                    parts.append({"type": "image"})
                if text:
                    parts.append({"type": "text", "text": text})
            message["content"] = parts
            found += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            found += sum(isinstance(part, dict) and part.get("type") == "image" for part in content)
    if found == 0 and num_images:
        user = next((m for m in messages if m.get("role") == "user"), None)
        if user is None:
            raise ValueError(f"{where}: the prompt has no user message to put its {num_images} image(s) in")
        text = user.get("content") or ""
        text_parts = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
        user["content"] = [{"type": "image"}] * num_images + text_parts
    elif found != num_images:
        raise ValueError(
            f"{where}: the prompt has {found} image placeholder(s) ({IMAGE_PLACEHOLDER!r} or image parts) for "
            f"{num_images} image(s); give one per image, or none to put every image before the text"
        )
    return messages


@dataclass
class VisionPrompter:
    """A vision-language checkpoint's image processor and image token: what a prompt with images becomes.

    Attributes:
        image_processor: The folder's image processor (`load_image_processor`).
        image_token_id: The placeholder token (`config.image_token_id`, `<|image_pad|>` for Qwen-VL).
        merge_size: Patches merged into one visual token per side (`vision_config.spatial_merge_size`).
    """

    image_processor: Any
    image_token_id: int
    merge_size: int

    def prepare(self, ids: list[int], images: list[Image.Image]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The prompt ids with each image's placeholder expanded to its visual tokens (what the engine and the
        trainer see), and the trainer's image inputs (`pixel_values`, `image_grid_thw`).

        Raises:
            ValueError: the placeholders in `ids` do not match `images` (`expand_image_pads`).
        """
        processed = self.image_processor(images=images, return_tensors="pt")
        grid = processed["image_grid_thw"]
        expanded = expand_image_pads(ids, self.image_token_id, image_token_counts(grid, self.merge_size))
        return expanded, {"pixel_values": processed["pixel_values"], "image_grid_thw": grid}

    def token_counts(self, images: list[Image.Image]) -> list[int]:
        """Visual tokens each image takes in the prompt."""
        grid = self.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        return image_token_counts(grid, self.merge_size)


def load_vision_prompter(path: str, trust_remote_code: bool = False) -> VisionPrompter | None:
    """The `VisionPrompter` of an HF folder, or None for a text-only model (no `vision_config`)."""
    from transformers import AutoConfig

    config = load_pretrained(AutoConfig, path, trust_remote_code)
    if not is_vision_language(config):
        return None
    return VisionPrompter(
        load_image_processor(path, trust_remote_code),
        int(config.image_token_id),
        int(config.vision_config.spatial_merge_size),
    )


class Dataset:
    """Prompt samples built from records, with a deterministic per-epoch order.

    Args:
        records: The raw records (dicts), e.g. from `read_records`.
        tokenizer: A Hugging Face tokenizer; needed for `apply_chat_template` and `max_prompt_len`.
        source: Where the records came from (a file path), quoted in error messages.
        locations: One label per record ("line 3", "row 7") for error messages; defaults to "record N".
        input_key: Record key holding the prompt: a string, or a list of chat messages.
        label_key: Record key holding the label; None leaves labels empty.
        metadata_key: Record key holding a dict (or a JSON string of one) copied into `Sample.metadata`.
        tool_key: Record key holding tool definitions; passed to the chat template as `tools=` and
            kept in `Sample.metadata["tools"]` for custom generate functions.
        apply_chat_template: Render the prompt with the tokenizer's chat template (a plain string
            becomes one user message), so `Sample.prompt` is the text the engine sees.
        apply_chat_template_kwargs: Extra keyword arguments for `tokenizer.apply_chat_template`.
        max_prompt_len: Drop prompts with more tokens than this (None keeps all); images count their visual tokens.
        seed: Base seed of `shuffle`; epoch `e` uses `seed + e`.
        multimodal_keys: `{"image": field}` (`--multimodal-keys`): the record field holding each prompt's images
            (see `read_images`, `_with_image_parts`); the prompt becomes chat messages.
        vision: Counts images' visual tokens for `max_prompt_len` (`load_vision_prompter`).
    """

    def __init__(
        self,
        records: list[dict[str, Any]],
        tokenizer: Any = None,
        *,
        source: str = "<records>",
        locations: list[str] | None = None,
        input_key: str = "input",
        label_key: str | None = None,
        metadata_key: str = "metadata",
        tool_key: str = "tools",
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        max_prompt_len: int | None = None,
        seed: int = 42,
        multimodal_keys: dict[str, str] | None = None,
        vision: VisionPrompter | None = None,
    ):
        if multimodal_keys and max_prompt_len is not None and vision is None:
            raise ValueError("--rollout-max-prompt-len with --multimodal-keys needs the model's image processor")
        if (apply_chat_template or max_prompt_len is not None) and tokenizer is None:
            raise ValueError(
                "--apply-chat-template and --rollout-max-prompt-len need a tokenizer; pass --hf-checkpoint"
            )
        if apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "--apply-chat-template is set but the tokenizer from --hf-checkpoint has no chat template; "
                "drop --apply-chat-template or use a checkpoint that ships one"
            )
        self.source = source
        self.tokenizer = tokenizer
        self.apply_chat_template = apply_chat_template
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.seed = seed
        self.image_key = (multimodal_keys or {}).get("image")
        self.base_dir = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else "."
        self.vision = vision
        if locations is None:
            locations = [f"record {i}" for i in range(1, len(records) + 1)]

        samples = []
        for index, (where, record) in enumerate(zip(locations, records)):
            where = f"{source}, {where}"
            samples.append(self._build_sample(record, where, index, input_key, label_key, metadata_key, tool_key))
        if not samples:
            raise ValueError(f"'{source}' holds no records; point the data flag at a non-empty file")
        if max_prompt_len is not None:
            samples = self._drop_long_prompts(samples, max_prompt_len)
        if not samples:
            raise ValueError(
                f"every prompt in '{source}' is longer than --rollout-max-prompt-len={max_prompt_len}; raise it"
            )
        self.samples = samples
        self.order = list(range(len(samples)))

    def _build_sample(
        self,
        record: dict[str, Any],
        where: str,
        index: int,
        input_key: str,
        label_key: str | None,
        metadata_key: str,
        tool_key: str,
    ) -> Sample:
        if input_key not in record:
            raise KeyError(
                f"{where}: no key '{input_key}' (keys present: {sorted(record)}); "
                "pass --input-key with the key that holds the prompt"
            )
        if label_key is not None and label_key not in record:
            raise KeyError(
                f"{where}: no key '{label_key}' (keys present: {sorted(record)}); "
                "pass --label-key with the key that holds the label"
            )
        prompt = record[input_key]
        metadata = _maybe_parse_json(record.get(metadata_key), f"'{metadata_key}'", where) or {}
        if not isinstance(metadata, dict):
            raise ValueError(f"{where}: '{metadata_key}' must be a dict (or its JSON), got {type(metadata).__name__}")
        metadata = dict(metadata)
        tools = _maybe_parse_json(record.get(tool_key), f"'{tool_key}'", where)
        if tools is not None:
            metadata.setdefault("tools", tools)
        images = self._images(record, f"{where} (sample {index})")
        if images is not None:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            prompt = _with_image_parts(messages, len(images), f"{where} (sample {index})")
        if self.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            prompt = self._render_chat(messages, tools)
        return Sample(
            prompt=prompt,
            label=record[label_key] if label_key else None,
            metadata=metadata,
            multimodal_inputs={"images": images} if images else None,
        )

    def _images(self, record: dict[str, Any], where: str) -> list[Image.Image] | None:
        """The record's images under `--multimodal-keys` (None without the flag)."""
        if self.image_key is None:
            return None
        if self.image_key not in record:
            raise KeyError(
                f"{where}: no key '{self.image_key}' (keys present: {sorted(record)}); --multimodal-keys names it "
                "as the field holding the images (an empty list for a prompt without any)"
            )
        value = record[self.image_key]
        if value is None:
            return []
        return read_images(value, f"{where}, '{self.image_key}'", self.base_dir)

    def _render_chat(self, messages: list[dict[str, Any]], tools: Any) -> str:
        kwargs = {"add_generation_prompt": True, **self.apply_chat_template_kwargs}
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)

    def _drop_long_prompts(self, samples: list[Sample], max_prompt_len: int) -> list[Sample]:
        # Messages that were not templated are counted as the engine will see them: through the template.
        texts = [
            s.prompt if isinstance(s.prompt, str) else self._render_chat(s.prompt, s.metadata.get("tools"))
            for s in samples
        ]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        for i, sample in enumerate(samples):
            images = (sample.multimodal_inputs or {}).get("images")
            if images:  # each image's one placeholder token becomes its visual tokens
                lengths[i] += sum(self.vision.token_counts(images)) - len(images)
        kept = [s for s, n in zip(samples, lengths) if n <= max_prompt_len]
        if len(kept) < len(samples):
            logger.info(
                "dropped %d of %d prompts from %s longer than --rollout-max-prompt-len=%d tokens",
                len(samples) - len(kept),
                len(samples),
                self.source,
                max_prompt_len,
            )
        return kept

    def shuffle(self, epoch_id: int) -> None:
        """Set the order of epoch `epoch_id`: a permutation that depends only on `seed + epoch_id`.

        Args:
            epoch_id: The epoch; the same epoch always gets the same order, so a resumed run
                replays it exactly.
        """
        self.order = list(range(len(self.samples)))
        random.Random(self.seed + epoch_id).shuffle(self.order)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, position: int) -> Sample:
        """The prompt sample at `position` of the current epoch order (shared; copy before changing it)."""
        return self.samples[self.order[position]]


def load_dataset(path: str, args: Any, tokenizer: Any = None, flag: str = "--prompt-data", **overrides: Any) -> Dataset:
    """Build a `Dataset` from a file, with settings read from parsed arguments.

    Args:
        path: The JSONL / Parquet file.
        args: Parsed arguments; reads input_key, label_key, metadata_key, tool_key, apply_chat_template,
            apply_chat_template_kwargs, rollout_max_prompt_len, rollout_seed and multimodal_keys (with
            hf_checkpoint, for the image processor that counts visual tokens).
        tokenizer: A Hugging Face tokenizer, when the settings need one.
        flag: The flag that named `path`, for error messages (e.g. "--eval-prompt-data aime").
        **overrides: `Dataset` keyword arguments that replace the ones from `args` (per-eval-set keys).

    Returns:
        The dataset, in file order (call `shuffle` for an epoch order).
    """
    settings = dict(
        input_key=args.input_key,
        label_key=args.label_key,
        metadata_key=args.metadata_key,
        tool_key=args.tool_key,
        apply_chat_template=args.apply_chat_template,
        apply_chat_template_kwargs=args.apply_chat_template_kwargs,
        max_prompt_len=args.rollout_max_prompt_len,
        seed=args.rollout_seed,
        multimodal_keys=args.multimodal_keys,
    )
    settings.update(overrides)
    if settings["multimodal_keys"] and settings["max_prompt_len"] is not None:
        settings["vision"] = load_vision_prompter(args.hf_checkpoint, args.trust_remote_code)
    locations, records = [], []
    for where, record in iter_records(path, flag):
        locations.append(where)
        records.append(record)
    return Dataset(records, tokenizer, source=path, locations=locations, **settings)
