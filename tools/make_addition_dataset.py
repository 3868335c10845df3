"""Write a two-digit addition prompt set (train + held-out eval) as JSONL.

Each line: {"prompt": "What is 37 + 58? ...", "label": "95"}. Train and eval pairs never overlap.

    python tools/make_addition_dataset.py --output-dir data/addition --num-train 2000 --num-eval 100
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROMPT = "What is {a} + {b}? Reply with only the number."


def make_pairs(num_train: int, num_eval: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Distinct (a, b) pairs with 10 <= a, b <= 99, split into train and eval."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    if num_train + num_eval > len(pairs):
        raise ValueError(f"only {len(pairs)} distinct two-digit pairs exist; asked for {num_train + num_eval}")
    random.Random(seed).shuffle(pairs)
    return pairs[num_eval : num_eval + num_train], pairs[:num_eval]


def write_jsonl(path: Path, pairs: list[tuple[int, int]]) -> None:
    with path.open("w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": PROMPT.format(a=a, b=b), "label": str(a + b)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="data/addition")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-eval", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, evaluation = make_pairs(args.num_train, args.num_eval, args.seed)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "eval.jsonl", evaluation)
    print(f"wrote {len(train)} train and {len(evaluation)} eval prompts to {out}")


if __name__ == "__main__":
    main()
