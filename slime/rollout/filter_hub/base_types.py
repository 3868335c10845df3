"""What a dynamic-sampling filter (`--dynamic-sampling-filter-path`) returns, and how a rollout applies it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    """Verdict on one prompt group.

    Args:
        keep: Whether the group goes into the training batch.
        reason: Why it was dropped (for logs and the `rollout/dynamic_filter/drop_<reason>` metric); None when kept.
        keep_when_insufficient: Keep the group after all when dropping it would leave fewer candidate groups than
            the batch needs, instead of drawing more prompts.
    """

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def call_dynamic_filter(fn: Callable | None, *args, **kwargs) -> DynamicFilterOutput:
    """`fn(*args, **kwargs)` as a `DynamicFilterOutput`: a filter may return a bare bool, and no filter keeps all."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    return output if isinstance(output, DynamicFilterOutput) else DynamicFilterOutput(keep=bool(output))


def should_drop_dynamic_filter_output(
    output: DynamicFilterOutput, *, remaining_batch_size: int, target_data_size: int
) -> bool:
    """Whether a rollout drops the group `output` judged.

    Args:
        output: The filter's verdict.
        remaining_batch_size: Groups still in the running for the batch (kept, in flight, and this one).
        target_data_size: Groups the batch needs (`--rollout-batch-size`).
    """
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


class MetricGatherer:
    """Counts a rollout's dynamic-filter drops by reason; `collect()` gives `rollout/dynamic_filter/drop_<reason>`."""

    def __init__(self):
        self.drops: Counter[str] = Counter()

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self.drops[reason] += 1

    def collect(self) -> dict[str, float]:
        return {f"rollout/dynamic_filter/drop_{reason}": float(count) for reason, count in self.drops.items()}
