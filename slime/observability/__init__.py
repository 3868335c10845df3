"""Upstream slime's observability package, for plugins written against it (custom rollout log functions, timers):

    logging_utils   configure_logger, log(args, metrics, step_key): metrics that join the rollout's logged row
    metric_utils    compute_rollout_step(args, rollout_id): the x axis upstream's plugins put in their metrics
    timer           Timer, timer, inverse_timer (slime.utils.timer)

slime's own metrics, trackers and timers live in slime.utils (tracking, timer); these modules are their upstream
names.
"""
