"""The run folder (`--save` / `--load`) and its checkpoint unit.

    DIR/latest_checkpointed_iteration.txt   the tracker: the last step whose every part is written
    DIR/iter_XXXXXXX/                       the actor's trainer state of that step (backend format)
    DIR/critic/iter_XXXXXXX/                the critic's (PPO); DIR/critic follows DIR's tracker
    DIR/rollout/data_source_X.pt            the data source position of that step
    DIR/metrics.jsonl                       one row per logged rollout

A checkpoint of step N is one unit: the driver writes every part of N, then the tracker (one rename).
A kill in between leaves the tracker on the previous step, and every part of it is there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from slime.utils.atomic_dir import atomic_write_text

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CRITIC_DIR = "critic"
METRICS_FILE = "metrics.jsonl"
DATA_SOURCE_DIR = "rollout"
_ITER_DIR = re.compile(r"^iter_\d{7}$")
_DATA_SOURCE_FILE = re.compile(r"^data_source_\d+\.pt$")


def tracker_file(root: str | Path) -> Path:
    """The tracker that names the step to load from a role folder.

    `DIR/critic` has none of its own inside a run: it follows `DIR`'s, so actor and critic always
    load the same step. A critic folder saved on its own (no tracker above it) keeps its own.
    """
    root = Path(root)
    if root.name == CRITIC_DIR and (root.parent / TRACKER_FILE).is_file():
        return root.parent / TRACKER_FILE
    return root / TRACKER_FILE


def iteration_dir(root: str | Path, step: int) -> Path:
    """`root/iter_XXXXXXX`."""
    return Path(root) / f"iter_{int(step):07d}"


def data_source_file(root: str | Path, step: int) -> Path:
    """`root/rollout/data_source_X.pt`."""
    return Path(root) / DATA_SOURCE_DIR / f"data_source_{step}.pt"


def committed_step(root: str | Path | None) -> int | None:
    """The step `root`'s tracker names, or None without a tracker (or a non-numeric one such as "release")."""
    if not root:
        return None
    tracker = Path(root) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return int(text) if text.isdigit() else None


def commit_step(root: str | Path, step: int) -> None:
    """Point `root`'s tracker at `step` in one rename: from now on `--load root` resumes from it."""
    atomic_write_text(Path(root) / TRACKER_FILE, str(step))


def holds_run(root: str | Path | None) -> list[str]:
    """What in `root` shows an earlier run was written there (empty when none): tracker, checkpoints, metrics."""
    if not root or not os.path.isdir(root):
        return []
    root = Path(root)
    found = [name for name in (TRACKER_FILE, METRICS_FILE) if (root / name).exists()]
    found += sorted(entry.name + "/" for entry in root.iterdir() if _ITER_DIR.match(entry.name))[:3]
    rollout = root / DATA_SOURCE_DIR
    if rollout.is_dir() and any(_DATA_SOURCE_FILE.match(name) for name in os.listdir(rollout)):
        found.append(f"{DATA_SOURCE_DIR}/data_source_*.pt")
    return found


def missing_parts(root: str | Path, step: int, roles: list[str], data_source: bool) -> list[str]:
    """The parts of checkpoint `step` under `root` that are absent (paths relative to `root`).

    Args:
        root: The run folder.
        step: The step to check.
        roles: The trainers whose state must be there: "actor" (in `root`), "critic" (in `root/critic`).
        data_source: The data source is slime's own, so its file must be there.
    """
    root = Path(root)
    wanted = [iteration_dir(root if role == "actor" else root / CRITIC_DIR, step) for role in roles]
    if data_source:
        wanted.append(data_source_file(root, step))
    return [str(path.relative_to(root)) for path in wanted if not path.exists()]
