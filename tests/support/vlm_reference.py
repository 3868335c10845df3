"""Reference log-probs of a vision-language sample: one HF forward of the whole sequence with all its images."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_log_probs(model, processor, tokens: list[int], images: list, response_length: int) -> torch.Tensor:
    """Log-probs of the last `response_length` tokens of `tokens` under `model` (an HF image-text-to-text model),
    its image processor `processor` turning `images` (in token order) into pixels; the model places its own M-RoPE."""
    processed = processor(images=images, return_tensors="pt")
    ids = torch.tensor([tokens])
    logits = model(
        input_ids=ids,
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        pixel_values=processed["pixel_values"],
        image_grid_thw=processed["image_grid_thw"],
    ).logits[0, -response_length - 1 : -1]
    return logits.log_softmax(-1).gather(-1, ids[0, -response_length:, None])[:, 0]
