"""Draw a whole run from `{save}/metrics.jsonl` in one PNG: a grid of panels (reward, held-out accuracy, pass@k,
KL, entropy, response length, truncation, clip fraction, step-time breakdown), each only when the run logged it.

python tools/plot_metrics.py outputs/quickstart-grpo/metrics.jsonl --output outputs/quickstart-grpo/curves.png
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on training machines
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from slime.utils.perf import STEP_PHASES  # noqa: E402

PANEL_INCHES = (4.8, 3.4)  # width, height of one panel
DPI = 100
MAX_COLUMNS = 3


@dataclass
class Panel:
    """One subplot: `draw` fills the axes; `plot` sets the title, labels and grid around it."""

    title: str
    ylabel: str
    draw: Callable[[Axes], None]
    xlabel: str = "rollout"


def load_history(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, in file order; blank lines are skipped.

    Raises:
        SystemExit: the file is missing, holds no rows, or a line is not a JSON object with an integer
            `rollout_id` (the message names the file and line).
    """
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: pass the metrics.jsonl written under a run's --save directory")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(
                f"{path} line {number} is not JSON ({e.msg}): fix or delete that line "
                "(a run killed while writing can leave its last line cut short)"
            ) from None
        rollout_id = row.get("rollout_id") if isinstance(row, dict) else None
        if not isinstance(rollout_id, int) or isinstance(rollout_id, bool):
            raise SystemExit(
                f"{path} line {number} is not a metrics row: each line must be a JSON object with an integer "
                '"rollout_id", as train.py writes them'
            )
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path} holds no JSON rows: the run logged no rollout yet (one row is written per rollout)")
    return rows


def latest_rows(rows: list[dict]) -> list[dict]:
    """One row per rollout_id, sorted by it; a repeated id (a resumed run redoing a rollout) keeps its last row."""
    return [row for _, row in sorted({row["rollout_id"]: row for row in rows}.items())]


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(row["rollout_id"], float(row[key])) for row in rows if _number(row.get(key))]
    return [p[0] for p in points], [p[1] for p in points]


def step_time_breakdown(rows: list[dict]) -> dict[str, list[float]]:
    """Seconds of each step phase, and "other" (what the phases leave of `perf/step_time`, 0 when they cover it),
    for each row that has `perf/step_time`, in row order. A phase a row lacks counts 0."""
    timed = [row for row in rows if _number(row.get("perf/step_time"))]
    phases = {
        name: [float(row[f"perf/{name}_time"]) if _number(row.get(f"perf/{name}_time")) else 0.0 for row in timed]
        for name in STEP_PHASES
    }
    other = [max(0.0, row["perf/step_time"] - sum(p[i] for p in phases.values())) for i, row in enumerate(timed)]
    return {**phases, "other": other}


def eval_sets(rows: list[dict]) -> list[str]:
    """Names of the eval sets: the `<set>` of every `eval/<set>` key."""
    return sorted({key[5:] for row in rows for key in row if key.startswith("eval/") and key.count("/") == 1})


def curves_panel(title: str, ylabel: str, rows: list[dict], keys: dict[str, str]) -> Panel | None:
    """Lines of `keys` ({legend label: metric key}) over rollouts; None when no key has a value."""
    lines = {label: _series(rows, key) for label, key in keys.items()}
    lines = {label: xy for label, xy in lines.items() if xy[0]}
    if not lines:
        return None

    def draw(ax: Axes) -> None:
        for label, (xs, ys) in lines.items():
            sparse = len(xs) < len(rows) / 2  # eval rows: a few points, so mark each
            ax.plot(xs, ys, marker="o" if sparse else ".", markersize=4 if sparse else 2, label=label)
        if list(lines) != [title]:  # a lone line named like its panel needs no legend
            ax.legend(fontsize="small")

    return Panel(title, ylabel, draw)


def _pass_at_k(row: dict, prefix: str) -> list[tuple[int, float]]:
    """(k, pass@k) of the `{prefix}/pass@<k>` keys of a row, by k."""
    points = []
    for key, value in row.items():
        match = re.fullmatch(r"pass@(\d+)", key.removeprefix(prefix + "/")) if key.startswith(prefix + "/") else None
        if match and _number(value):
            points.append((int(match.group(1)), float(value)))
    return sorted(points)


def pass_at_k_panel(rows: list[dict], sets: list[str]) -> Panel | None:
    """pass@k against k at the first (dashed) and last (solid) rollout that logged it, per eval set and training."""
    curves = []  # (label, points, dashed, color)
    for index, (name, prefix) in enumerate([*((s, f"eval/{s}") for s in sets), ("training", "rollout")]):
        logged = [(row["rollout_id"], points) for row in rows if (points := _pass_at_k(row, prefix))]
        if len(logged) > 1:
            curves.append((f"{name} @ rollout {logged[0][0]}", logged[0][1], True, f"C{index}"))
        if logged:
            curves.append((f"{name} @ rollout {logged[-1][0]}", logged[-1][1], False, f"C{index}"))
    if not curves:
        return None

    def draw(ax: Axes) -> None:
        for label, points, dashed, color in curves:
            ks, values = zip(*points)
            ax.plot(ks, values, "--" if dashed else "-", marker="o", markersize=4, color=color, label=label)
        ax.legend(fontsize="small")

    return Panel("pass@k", "pass@k", draw, xlabel="k")


def step_time_panel(rows: list[dict]) -> Panel | None:
    """Stacked bars per rollout: the step phases and the "other" remainder; phases that are always 0 left out."""
    xs = [row["rollout_id"] for row in rows if _number(row.get("perf/step_time"))]
    if not xs:
        return None
    parts = {name: seconds for name, seconds in step_time_breakdown(rows).items() if any(s > 0 for s in seconds)}

    def draw(ax: Axes) -> None:
        bottom = [0.0] * len(xs)
        for name, seconds in parts.items():
            ax.bar(xs, seconds, bottom=bottom, label=name, color="0.6" if name == "other" else None, width=0.8)
            bottom = [b + s for b, s in zip(bottom, seconds)]
        ax.set_ylim(0, max(bottom) * 1.3 or 1)  # headroom so the legend sits above the bars
        if parts:
            ax.legend(fontsize="x-small", ncols=4, loc="upper center")

    return Panel("step time", "seconds", draw)


def build_panels(rows: list[dict]) -> list[Panel]:
    """The panels these rows have data for, in drawing order."""
    sets = eval_sets(rows)
    panels = [
        curves_panel("training reward", "mean reward", rows, {"training reward": "rollout/reward"}),
        curves_panel("held-out accuracy", "mean reward", rows, {s: f"eval/{s}" for s in sets}),
        pass_at_k_panel(rows, sets),
        curves_panel("KL", "KL", rows, {"kl_loss (to reference)": "train/kl_loss", "ppo_kl": "train/ppo_kl"}),
        curves_panel("entropy", "entropy", rows, {"entropy": "train/entropy_loss"}),
        curves_panel(
            "response length",
            "tokens",
            rows,
            {"training": "rollout/response_length", **{s: f"eval/{s}/response_length" for s in sets}},
        ),
        curves_panel(
            "truncated", "fraction", rows, {"training": "rollout/truncated", **{s: f"eval/{s}/truncated" for s in sets}}
        ),
        curves_panel("clip fraction", "fraction", rows, {"clip fraction": "train/pg_clipfrac"}),
        step_time_panel(rows),
    ]
    return [p for p in panels if p is not None]


def plot(history: list[dict], output: Path) -> list[str]:
    """Draw every panel the run has data for into one PNG at `output`; returns the titles of the panels drawn.

    `history` holds rows as `load_history` returns them; a repeated rollout_id keeps its last row.

    Raises:
        ValueError: no row holds a metric any panel draws.
    """
    rows = latest_rows(history)
    panels = build_panels(rows)
    if not panels:
        raise ValueError(
            "no metric to plot: no row holds rollout/reward, eval/<set>, pass@<k>, train/kl_loss, train/ppo_kl, "
            "train/entropy_loss, train/pg_clipfrac, rollout/response_length, rollout/truncated or perf/step_time"
        )
    columns = min(MAX_COLUMNS, len(panels))
    grid_rows = math.ceil(len(panels) / columns)
    width, height = PANEL_INCHES
    fig, axes = plt.subplots(grid_rows, columns, figsize=(width * columns, height * grid_rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        panel.draw(ax)
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.remove()
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=DPI)
    plt.close(fig)
    return [panel.title for panel in panels]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--output", type=Path, default=None, help="PNG path (default: curves.png beside the metrics)")
    args = parser.parse_args()
    output = args.output or args.metrics.with_name("curves.png")
    try:
        titles = plot(load_history(args.metrics), output)
    except ValueError as e:
        raise SystemExit(f"{args.metrics}: {e}") from None
    print(f"saved {output}: {', '.join(titles)}")


if __name__ == "__main__":
    main()
