"""What a dynamic-sampling filter (`--dynamic-sampling-filter-path`) returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    """Verdict on one prompt group.

    Args:
        keep: Whether the group goes into the training batch.
        reason: Why it was dropped (for logs and metrics); None when kept.
    """

    keep: bool
    reason: str | None = None
