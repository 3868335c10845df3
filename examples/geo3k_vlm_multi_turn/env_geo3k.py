"""The environment of the multi-turn geo3k example: it checks each answer and answers a wrong one with a closer look.

After every model turn the checker reads the last `\\boxed{...}` of the turn. The right number ends the episode;
anything else gets a tool message back: a short verdict and the drawing zoomed onto its ink (cropped to the pixels
that differ from the background, then scaled back to the picture's size), drawn offline with PIL. The model then
answers again with both pictures in its context.
"""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageChops

from slime.rollout.rm_hub.math_utils import extract_boxed_answer

FEEDBACK = "That is not the answer. Here is a closer look at the drawing; count again and answer in \\boxed{}."
# Pixels of background kept around the ink, so that strokes at the edge of the crop stay whole.
MARGIN = 2


def zoom(image: Image.Image) -> Image.Image:
    """`image` cropped to its ink (pixels other than the top-left corner's colour), `MARGIN` pixels around it, and
    resized back to `image.size`; a copy of `image` when it is all background."""
    background = Image.new("RGB", image.size, image.getpixel((0, 0)))
    box = ImageChops.difference(image.convert("RGB"), background).getbbox()
    if box is None:
        return image.copy()
    left, top, right, bottom = box
    width, height = image.size
    box = (max(left - MARGIN, 0), max(top - MARGIN, 0), min(right + MARGIN, width), min(bottom + MARGIN, height))
    return image.crop(box).resize(image.size, Image.Resampling.BICUBIC)


def step(image: Image.Image, label: str, text: str) -> dict[str, Any] | None:
    """The environment's answer to a model turn `text` about `image`: None when its `\\boxed{}` answer is `label`
    (the episode ends), else a tool message holding the verdict and the zoomed drawing (an HF image part)."""
    answer = extract_boxed_answer(text)
    if answer is not None and answer.strip() == str(label).strip():
        return None
    return {"role": "tool", "content": [{"type": "text", "text": FEEDBACK}, {"type": "image", "image": zoom(image)}]}
