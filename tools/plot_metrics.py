"""Plot a run's training reward and eval accuracy from `{save}/metrics.jsonl`.

python tools/plot_metrics.py outputs/quickstart-grpo/metrics.jsonl --output outputs/quickstart-grpo/curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt  # noqa: E402


def load_history(path: Path) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: pass the metrics.jsonl written under a run's --save directory")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(history: list[dict], output: Path) -> None:
    """Training reward per rollout (left) and each eval set's accuracy (right)."""
    fig, (reward_ax, eval_ax) = plt.subplots(1, 2, figsize=(11, 4))
    train = [h for h in history if "rollout/reward" in h]
    reward_ax.plot([h["rollout_id"] for h in train], [h["rollout/reward"] for h in train], marker=".")
    reward_ax.set(title="training reward", xlabel="rollout", ylabel="mean reward")
    eval_names = sorted({k for h in history for k in h if k.startswith("eval/") and k.count("/") == 1})
    for name in eval_names:
        points = sorted({h["rollout_id"]: h[name] for h in history if name in h}.items())
        eval_ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name[5:])
    eval_ax.set(title="held-out accuracy", xlabel="rollout", ylabel="mean reward")
    if eval_names:
        eval_ax.legend()
    for ax in (reward_ax, eval_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    print(f"saved {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--output", type=Path, default=None, help="PNG path (default: beside the metrics file)")
    args = parser.parse_args()
    plot(load_history(args.metrics), args.output or args.metrics.with_name("curves.png"))


if __name__ == "__main__":
    main()
