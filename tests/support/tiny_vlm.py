"""Build a tiny random-weight Qwen-VL model (vision tower included) with a real tokenizer and image processor.

Nothing is downloaded: the tokenizer is tiny_model's byte-level BPE plus Qwen's vision tokens, the image processor is
transformers' own (its PIL variant, which needs no torchvision) with a small pixel budget, so a 56x56 image is a 4x4
patch grid and 4 visual tokens. Saved with `save_pretrained`, so every loading path is the real one.
"""

from __future__ import annotations

import base64
import copy
import io
from pathlib import Path

import torch
import transformers
from PIL import Image

from support.tiny_model import build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# Qwen-VL's template shape: content is a string or a list of parts; an image part becomes the placeholder.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Per arch: config class name, vision patch size, and the text / vision config fields only that family has. Class
# names, not classes: importing the VL classes costs ~0.8 s, and most importers of this module only make images.
ARCHS = {
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        14,
        {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        {"window_size": 56, "fullatt_block_indexes": [1]},
    ),
    "qwen3_vl": (
        "Qwen3VLConfig",
        16,
        {
            "head_dim": 16,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
        {"num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
    ),
}


def build_tiny_vlm(path: str | Path, arch: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """Save a random-weight `arch` ("qwen2_5_vl" or "qwen3_vl") model, its tokenizer and image processor to `path`."""
    path = Path(path)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    tokens = dict(vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video)
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; use 'qwen2_5_vl' or 'qwen3_vl'")
    config_class_name, patch, text_fields, vision_fields = ARCHS[arch]
    # Deep copies: the config classes rewrite `rope_scaling` in place, which would leak into the next build.
    text_fields, vision_fields = copy.deepcopy(text_fields), copy.deepcopy(vision_fields)
    config = getattr(transformers, config_class_name)(
        text_config={**text, **text_fields},
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=patch,
            spatial_merge_size=2,
            temporal_patch_size=2,
            **vision_fields,
        ),
        tie_word_embeddings=False,
        **tokens,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    # Larger-than-default init (as tiny_model) so image features and positions visibly move the logits.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # At most 4x4 merged tokens per image: a 56x56 (Qwen2.5) / 64x64 (Qwen3) image is 4 tokens.
    side = patch * 2
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=side * side, max_pixels=(4 * side) ** 2
    ).save_pretrained(path)
    return path


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB image of random pixels."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
