"""Tokenizers, processors and images of vision-language models, shared by the rollout side and the engines.

Images travel to an engine as SGLang's `image_data`: one string per image, PNG in base64 (what
`encode_image_for_rollout_engine` writes) or a `data:` URL. Runs are offline: an http(s) URL is refused rather than
fetched. Only the data reader opens local image files (`load_image(..., allow_path=True)`): an engine's clients must
not be able to make it read files on its host. A prompt holds the model's image placeholder token (`<|image_pad|>` for Qwen-VL)
either once per image, as the chat template writes it, or repeated once per visual token, as the HF processor
expands it; `expand_image_pads` turns either form into the expanded one the model (and the trainer) sees.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from slime.utils.misc import load_pretrained
from slime.utils.misc import load_tokenizer as _load_tokenizer

logger = logging.getLogger(__name__)

# How much of a bad image input an error message quotes.
_QUOTE_CHARS = 60
MAX_IMAGE_FILE_BYTES = 64 * 2**20


def is_vision_language(config: Any) -> bool:
    """Whether an HF config (a `PretrainedConfig`, or config.json as a dict) is a vision-language model's: it has a
    `vision_config` and transformers serves its `model_type` as image-text-to-text. The one test the trainer, the
    engine, the rollout and the argument checks share."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    if get("vision_config") is None:
        return False  # before the import below: the driver checks its flags without importing transformers (~1 s)
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def load_tokenizer(name_or_path: str, **kwargs: Any):
    """Upstream's name for `slime.utils.misc.load_tokenizer`: the folder's tokenizer, with its processor's chat
    template when the tokenizer has none. Python code in the folder runs only with `trust_remote_code=True`."""
    return _load_tokenizer(name_or_path, kwargs.pop("trust_remote_code", False), **kwargs)


def load_processor(name_or_path: str, **kwargs: Any):
    """The folder's multimodal HF processor (`AutoProcessor`), or None for a text-only model.

    A folder whose processor cannot be built logs why and gives None, as does one whose "processor" is a plain
    tokenizer. Qwen-VL processors need `torchvision` (for their video part): without it this returns None and says so.
    """
    from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except Exception as error:  # a text-only folder (OSError, ValueError), or a processor needing a missing package
        hint = "" if _has_torchvision() else " (transformers builds Qwen-VL processors only with torchvision installed)"
        logger.warning("no processor for %s: %r%s", name_or_path, error, hint)
        return None
    if isinstance(processor, PreTrainedTokenizerBase) or not isinstance(processor, ProcessorMixin):
        return None
    return processor


def _has_torchvision() -> bool:
    from transformers.utils import is_torchvision_available

    return is_torchvision_available()


def load_image_processor(name_or_path: str, trust_remote_code: bool = False):
    """The folder's image processor (`AutoImageProcessor`; the PIL one when torchvision is missing): the image part of
    the processor, enough to turn images into `pixel_values` / `image_grid_thw`.

    Raises:
        ValueError: naming the folder when it has no image processor config.
    """
    from transformers import AutoImageProcessor

    if not (Path(name_or_path) / "preprocessor_config.json").is_file():
        raise ValueError(
            f"{name_or_path} has no preprocessor_config.json: a vision-language checkpoint needs its image processor "
            "saved beside the weights (processor.save_pretrained(folder))"
        )
    return load_pretrained(AutoImageProcessor, name_or_path, trust_remote_code)


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """Keyword arguments for `processor(text=..., **kwargs)`: the sample's multimodal inputs (`images`, ...) with text
    outputs as plain lists (token ids to store in a sample) and image / video / audio outputs as torch tensors (what the
    trainer feeds the model).

    `mm_token_type_ids` is asked for: transformers' Qwen-VL models need it beside `image_grid_thw` to place their 3-D
    (M-RoPE) positions; without it they fall back to text positions.
    """
    kwargs = dict(multimodal_inputs or {})
    kwargs["text_kwargs"] = {**kwargs.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": True}
    for key in ("images_kwargs", "videos_kwargs", "audio_kwargs"):
        kwargs[key] = {**kwargs.get(key, {}), "return_tensors": "pt"}
    return kwargs


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...'"


def load_image(image: Any, where: str = "image", allow_path: bool = False) -> Image.Image:
    """An RGB PIL image from a PIL image, raw bytes, a `data:image/...;base64,` URL, bare base64 or (with
    `allow_path`) a local file.

    Args:
        image: The image or its reference.
        where: How errors name this input (`image_data[2]`, `messages[0].content[1]`, ...).
        allow_path: Read a string that names an existing file from disk. Only for trusted input (the data files a run
            reads); left off, a string is decoded as base64 and the filesystem is never touched, so what a server's
            clients send cannot open files on its host.

    Raises:
        ValueError: naming `where` and the input when it is an http(s) URL (runs are offline), a path where paths are
            not read or a missing file, or bytes that are no image.
    """
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, bytes | bytearray):
        return _decode(bytes(image), where, "bytes")
    if not isinstance(image, str) or not image:
        expected = "a PIL image, a path, a data URL or base64 text" if allow_path else "a data URL or base64 text"
        raise ValueError(f"{where}: expected {expected}, got {type(image).__name__}")
    if image.startswith(("http://", "https://")):
        raise ValueError(
            f"{where}: {_quote(image)} is a web URL; images are never fetched (runs are offline): "
            f"send the image itself as base64 or a data URL{', or a local path' if allow_path else ''}"
        )
    if image.startswith("data:"):
        header, comma, payload = image.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ValueError(f"{where}: {_quote(image)} is not a base64 data URL (data:image/png;base64,...)")
        return _decode(_b64(payload, where, image, allow_path), where, "data URL")
    if allow_path and len(image) < 4096 and "\n" not in image:  # short enough to be a file name
        path = Path(image).expanduser()
        if path.is_file():  # regular files only: a FIFO would block the reader
            if path.stat().st_size > MAX_IMAGE_FILE_BYTES:
                raise ValueError(
                    f"{where}: the file {image!r} is larger than {MAX_IMAGE_FILE_BYTES} bytes; no image is"
                )
            return _decode(path.read_bytes(), where, f"file {str(path)!r}")
    return _decode(_b64(image, where, image, allow_path), where, "base64 text")


def _b64(text: str, where: str, original: str, allow_path: bool) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        if allow_path:
            problem = "is neither an existing image file nor base64 image data (nor a data URL)"
        else:  # most likely a file path: say why it is not read
            problem = (
                "is not base64 image data or a data URL; file paths are not read here: send the image itself as "
                "base64 or a data URL (data:image/png;base64,...)"
            )
        raise ValueError(f"{where}: {_quote(original)} {problem}") from None


def _decode(data: bytes, where: str, what: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as opened:
            opened.load()
            return opened.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"{where}: the {what} is no image in a format PIL reads (PNG, JPEG, ...)") from None
    except (OSError, ValueError, Image.DecompressionBombError) as error:  # truncated, corrupt, too many pixels
        raise ValueError(f"{where}: the {what} holds no readable image ({error})") from None


def encode_image_for_rollout_engine(image: Any) -> str:
    """The image as an engine's `image_data` item: PNG of its RGB pixels, in base64 (lossless, so the engine's
    pixels equal the trainer's). Takes what `load_image` takes without paths: a PIL image, bytes, base64, a data URL."""
    buffer = io.BytesIO()
    load_image(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def image_token_counts(image_grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Visual tokens each image takes in the prompt: its patch grid (t * h * w) over the merged patches (merge_size^2)."""
    return (image_grid_thw.prod(dim=-1) // merge_size**2).tolist()


def expand_image_pads(input_ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> list[int]:
    """`input_ids` with image `i`'s placeholder run made `counts[i]` tokens long.

    Each image is one run of `image_token_id`: either a single token (the chat template's form) or already
    `counts[i]` tokens (the processor's form, left as it is).

    Raises:
        ValueError: when the runs do not match the images in number or length.
    """
    runs: list[tuple[int, int]] = []  # (start, length)
    for pos, token in enumerate(input_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((pos, 1))
    if len(runs) != len(counts):
        raise ValueError(
            f"the prompt has {len(runs)} image placeholder(s) (runs of token {image_token_id}) for {len(counts)} "
            "image(s); give one placeholder per image, in order"
        )
    out: list[int] = []
    done = 0
    for i, ((start, length), count) in enumerate(zip(runs, counts)):
        if length not in (1, count):
            raise ValueError(
                f"image {i}'s placeholder is {length} tokens long; it must be 1 token (to be expanded) or the "
                f"{count} tokens this image takes"
            )
        out += list(input_ids[done:start]) + [image_token_id] * count
        done = start + length
    return out + list(input_ids[done:])
