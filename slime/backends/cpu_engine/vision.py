"""Images for vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): from `image_data` to model inputs.

A request's images go through the checkpoint's image processor (`pixel_values`, `image_grid_thw`); the prompt's
image placeholders are expanded to one token per visual token (`expand_image_pads`, the HF processor's layout, so
the tokens match what the trainer sees), and the prompt's 3-D M-RoPE positions are computed once, by the model's own
`get_rope_index`. The engine then passes positions explicitly on every forward: the model never falls back to the
`rope_deltas` it would otherwise cache on itself across requests. A generated token at step k sits at
`next_position + k` on all three axes, as in an HF forward over the whole sequence.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from slime.utils.processing_utils import expand_image_pads, image_token_counts, load_image, load_image_processor


@dataclass(eq=False)
class VisionInputs:
    """The images of one request, ready for the model.

    Args:
        pixel_values: The image processor's patches, all images concatenated.
        image_grid_thw: (images, 3) patch grid of each image.
        position_ids: (3, prompt length) M-RoPE positions of the expanded prompt.
        next_position: Position of the first generated token (the largest prompt position + 1).
        key: Digest of the pixels and grids; identical prompts with identical images are prefilled once.
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    position_ids: torch.Tensor
    next_position: int
    key: bytes


@dataclass
class Vision:
    """What an engine needs to take images for its model (see `load_vision`)."""

    image_processor: Any
    image_token_id: int
    merge_size: int
    rope_index: Any  # the model's `get_rope_index`

    def prepare(self, input_ids: list[int], images: list[Any], where: str) -> tuple[list[int], VisionInputs]:
        """Decode `images` (each what `load_image` takes), run the image processor, expand the prompt's placeholders.

        Returns:
            (expanded prompt ids, the request's `VisionInputs`).

        Raises:
            ValueError: naming `where` for an unreadable image or placeholders that do not match the images.
        """
        pictures = [load_image(image, f"{where}[{i}]") for i, image in enumerate(images)]
        processed = self.image_processor(images=pictures, return_tensors="pt")
        grid = processed["image_grid_thw"]
        try:
            ids = expand_image_pads(input_ids, self.image_token_id, image_token_counts(grid, self.merge_size))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        tokens = torch.tensor([ids])
        positions, delta = self.rope_index(
            tokens, mm_token_type_ids=(tokens == self.image_token_id).int(), image_grid_thw=grid
        )
        pixels = processed["pixel_values"]
        digest = hashlib.sha1(pixels.numpy().tobytes())
        digest.update(grid.numpy().tobytes())
        inputs = VisionInputs(pixels, grid, positions[:, 0], len(ids) + int(delta), digest.digest())
        return ids, inputs


def load_vision(model, model_path: str, trust_remote_code: bool = False) -> Vision:
    """The image side of a loaded vision-language `model`: its folder's image processor and the model's M-RoPE.

    Raises:
        ValueError: for a family whose positions or image tokens this engine does not know how to build.
    """
    config = model.config
    inner = getattr(model, "model", None)
    rope_index = getattr(inner, "get_rope_index", None)
    merge_size = getattr(config.vision_config, "spatial_merge_size", None)
    if rope_index is None or merge_size is None or getattr(config, "image_token_id", None) is None:
        raise ValueError(
            f"{model_path}: the CPU engine serves vision-language models of the Qwen-VL kind (an image token, merged "
            f"patches and M-RoPE positions: qwen2_vl, qwen2_5_vl, qwen3_vl, ...), not {config.model_type!r}"
        )
    processor = load_image_processor(model_path, trust_remote_code)
    return Vision(processor, int(config.image_token_id), int(merge_size), rope_index)
