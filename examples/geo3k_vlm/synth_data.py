"""Write a geometry-like vision-language prompt set, offline: PIL drawings of a regular polygon ("how many sides?") or
of scattered dots ("how many dots?"), each with its known answer.

    python examples/geo3k_vlm/synth_data.py --out data/geo3k_synth [--train 256 --test 32 --size 112 --seed 0]

Writes `train.jsonl` and `test.jsonl` (records `{"problem", "answer", "images"}` as upstream's geo3k set, the image
given by its path relative to the file, "<image>" marking where it goes in the prompt) and the PNGs under `images/`.
Train with `--input-key problem --label-key answer --multimodal-keys '{"image": "images"}'`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from PIL import Image, ImageDraw

QUESTIONS = {
    "sides": "<image>How many sides does the shape in the picture have? Put the final number in \\boxed{}.",
    "dots": "<image>How many dots are in the picture? Put the final number in \\boxed{}.",
}


def draw(kind: str, count: int, size: int, rng: random.Random) -> Image.Image:
    """A `size` x `size` picture of a regular polygon with `count` sides ("sides") or `count` dots ("dots")."""
    background = tuple(rng.randint(200, 255) for _ in range(3))
    ink = tuple(rng.randint(0, 120) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(image)
    if kind == "sides":
        radius, turn = size * rng.uniform(0.3, 0.45), rng.uniform(0, 2 * math.pi)
        corners = [
            (size / 2 + radius * math.cos(turn + 2 * math.pi * k / count),
             size / 2 + radius * math.sin(turn + 2 * math.pi * k / count))
            for k in range(count)
        ]  # fmt: skip
        pen.polygon(corners, outline=ink, width=max(1, size // 40))
        return image
    radius = max(2, size // 20)
    centres: list[tuple[float, float]] = []
    while len(centres) < count:  # non-overlapping: each dot stays countable
        x, y = rng.uniform(radius, size - radius), rng.uniform(radius, size - radius)
        if all((x - a) ** 2 + (y - b) ** 2 > (3 * radius) ** 2 for a, b in centres):
            centres.append((x, y))
    for x, y in centres:
        pen.ellipse((x - radius, y - radius, x + radius, y + radius), fill=ink)
    return image


def write_split(out: Path, name: str, num: int, size: int, rng: random.Random) -> Path:
    """`num` records of one split in `out/<name>.jsonl`, their images in `out/images/`."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(num):
        kind = rng.choice(sorted(QUESTIONS))
        count = rng.randint(3, 8) if kind == "sides" else rng.randint(1, 6)
        relative = f"images/{name}_{i:05d}.png"
        draw(kind, count, size, rng).save(out / relative)
        rows.append({"problem": QUESTIONS[kind], "answer": str(count), "images": [relative]})
    path = out / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="Output folder.")
    parser.add_argument("--train", type=int, default=256, help="Training prompts.")
    parser.add_argument("--test", type=int, default=32, help="Held-out prompts.")
    parser.add_argument("--size", type=int, default=112, help="Image side in pixels.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    for name, num in (("train", args.train), ("test", args.test)):
        print(f"wrote {write_split(args.out, name, num, args.size, rng)} ({num} prompts)")


if __name__ == "__main__":
    main()
