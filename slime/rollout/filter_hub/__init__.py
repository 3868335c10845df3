"""Dynamic-sampling filters: decide per prompt group whether it joins the training batch.

Pass one with `--dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.<name>`,
usually together with `--over-sampling-batch-size` so that dropped groups are replaced.
"""

from .base_types import DynamicFilterOutput, MetricGatherer, call_dynamic_filter, should_drop_dynamic_filter_output

__all__ = ["DynamicFilterOutput", "MetricGatherer", "call_dynamic_filter", "should_drop_dynamic_filter_output"]
