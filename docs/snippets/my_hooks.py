"""The smaller hooks, one function each, named after the flag that loads it."""

from __future__ import annotations

import logging

import torch

from slime.utils.types import Sample

logger = logging.getLogger(__name__)


# ---- rollout side (the rollout process) ----
# --8<-- [start:rollout_sample_hook]
async def rollout_sample_hook(args, sample: Sample, *, rollout_id: int, evaluation: bool) -> Sample | None:
    """--rollout-sample-hook-path: runs on each generated sample before its reward; None keeps the sample as is."""
    sample.metadata = {**(sample.metadata or {}), "response_chars": len(sample.response)}
    return None
    # --8<-- [end:rollout_sample_hook]


# --8<-- [start:rollout_sample_filter]
def rollout_sample_filter(args, groups: list[list[Sample]]) -> None:
    """--rollout-sample-filter-path: set `remove_sample` on samples not to train on (they keep their group place)."""
    for group in groups:
        for sample in group:
            sample.remove_sample = sample.response_length == 0
    # --8<-- [end:rollout_sample_filter]


# --8<-- [start:rollout_all_samples_process]
def rollout_all_samples_process(args, groups: list[list[Sample]], data_source) -> None:
    """--rollout-all-samples-process-path: sees every kept group and those the dynamic filter dropped."""
    logger.info("%d groups finished this rollout", len(groups))
    # --8<-- [end:rollout_all_samples_process]


# --8<-- [start:reward_post_process]
def reward_post_process(args, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """--custom-reward-post-process-path: (raw rewards to log, rewards to train on); here: minus the batch mean."""
    raw = [s.get_reward_value(args.reward_key) for s in samples]
    mean = sum(raw) / len(raw)
    return raw, [r - mean for r in raw]
    # --8<-- [end:reward_post_process]


# --8<-- [start:convert_samples_to_train_data]
def convert_samples_to_train_data(args, samples: list[Sample]) -> dict[str, list]:
    """--custom-convert-samples-to-train-data-path: the train data dict, one entry per sample in each list."""
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [s.get_reward_value(args.reward_key) for s in samples],
        "raw_reward": [s.get_reward_value(args.reward_key) for s in samples],
        "truncated": [int(s.status == Sample.Status.TRUNCATED) for s in samples],
        "loss_masks": [s.loss_mask or [1] * s.response_length for s in samples],
    }
    # --8<-- [end:convert_samples_to_train_data]


# --8<-- [start:rollout_log]
def rollout_log(rollout_id: int, args, samples: list[Sample], extra_metrics: dict, rollout_time: float) -> bool:
    """--custom-rollout-log-function-path: log what you like; True skips slime's own rollout metrics."""
    logger.info("rollout %d: %d samples in %.1f s", rollout_id, len(samples), rollout_time)
    return False
    # --8<-- [end:rollout_log]


# --8<-- [start:eval_rollout_log]
def eval_rollout_log(rollout_id: int, args, data: dict, extra_metrics: dict) -> bool:
    """--custom-eval-rollout-log-function-path: `data` is {name: {"rewards", "truncated", "samples"}}."""
    for name, result in data.items():
        logger.info("eval %s at rollout %d: %d samples", name, rollout_id, len(result["rewards"]))
    return False
    # --8<-- [end:eval_rollout_log]


# ---- trainer side (every training rank, on its shard) ----
# --8<-- [start:rollout_data_postprocess]
def rollout_data_postprocess(args, rollout_id: int, rollout_data: dict) -> None:
    """--rollout-data-postprocess-path: change the rank's data in place after advantages, before training."""
    rollout_data["advantages"] = [a.clamp(-5.0, 5.0) for a in rollout_data["advantages"]]
    # --8<-- [end:rollout_data_postprocess]


# --8<-- [start:custom_advantages]
def custom_advantages(args, data: dict) -> None:
    """--custom-advantage-function-path: set "advantages" and "returns" (per-sample 1D tensors); here: the reward."""
    data["advantages"] = [torch.full(m.shape, float(r)) for r, m in zip(data["rewards"], data["loss_masks"])]
    data["returns"] = data["advantages"]
    # --8<-- [end:custom_advantages]


# --8<-- [start:reinforce_loss]
def reinforce_loss(args, batch: dict, logits: torch.Tensor, sum_of_sample_mean) -> tuple[torch.Tensor, dict]:
    """--loss-type custom_loss --custom-loss-function-path (FSDP): REINFORCE on the response tokens.

    `logits` are the micro-batch's `[M, vocab]` response logits, `batch["target_tokens"]` the `[M]` tokens;
    `sum_of_sample_mean` reduces per-sample values to this micro-batch's share of the step's loss.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["target_tokens"].unsqueeze(-1)).squeeze(-1)
    per_sample = torch.split(log_probs, batch["response_lengths"])
    loss = sum_of_sample_mean([-lp * adv for lp, adv in zip(per_sample, batch["advantages"])])
    return loss, {"reinforce_loss": loss.detach()}
    # --8<-- [end:reinforce_loss]


# --8<-- [start:capped_tis]
def capped_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """--use-tis --custom-tis-function-path: weight each token's loss by min(pi_train / pi_rollout, --tis-clip)."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs)).clamp(max=args.tis_clip)
    mask = torch.cat(loss_masks).float()
    return pg_loss * ratio, loss_masks, {"tis_weight_mean": (ratio * mask).sum() / mask.sum().clamp(min=1)}
    # --8<-- [end:capped_tis]


# --8<-- [start:before_train_step]
def before_train_step(args, rollout_id: int, step_id: int, model, optimizer, opt_param_scheduler) -> None:
    """--custom-megatron-before-train-step-hook-path (both backends): runs before each optimizer step."""
    if rollout_id == 0 and step_id == 0:
        logger.info("first step, lr %s", optimizer.param_groups[0]["lr"])
    # --8<-- [end:before_train_step]
