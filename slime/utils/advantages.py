"""Advantages and returns of one rollout shard, per `--advantage-estimator` (math in slime.utils.ppo_utils).

Every per-token quantity is a list with one 1-D CPU tensor per sample, over its response tokens.
"""

from __future__ import annotations

from argparse import Namespace

import torch
import torch.distributed as dist

from slime.utils.misc import load_function
from slime.utils.ppo_utils import (
    build_token_level_rewards,
    compute_approx_kl,
    distributed_masked_whiten,
    get_advantages_and_returns_batch,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
)


def reward_kl(args: Namespace, data: dict) -> list[torch.Tensor]:
    """Per-token KL of the sampling policy to the reference (`--kl-loss-type` estimator), zeros without a reference."""
    if data.get("ref_log_probs") is None:
        return [torch.zeros(mask.shape, dtype=torch.float32) for mask in data["loss_masks"]]
    return [
        compute_approx_kl(log_probs, ref_log_probs, args.kl_loss_type)
        for log_probs, ref_log_probs in zip(data["log_probs"], data["ref_log_probs"], strict=True)
    ]


def compute_advantages_and_returns(
    args: Namespace,
    data: dict,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> None:
    """Set `data["advantages"]` and `data["returns"]` for this rank's samples, in place.

    - grpo / gspo / cispo: the (group-normalized) reward on every token.
    - reinforce_plus_plus: discounted returns of token rewards (`-kl_coef * kl`, reward on the last token).
    - reinforce_plus_plus_baseline: reward minus `kl_coef * kl` on every token.
    - ppo: GAE over the same token rewards with the critic's `data["values"]`.

    With `--custom-advantage-function-path`, `f(args, data)` replaces all of the above and must
    set both keys. `--normalize-advantages` then whitens the advantages over the trainable tokens of
    every data-parallel rank (a collective: every rank must call this).

    Args:
        args: Needs `advantage_estimator`, `kl_coef`, `kl_loss_type`, `gamma`, `lambd`, `normalize_advantages`,
            `custom_advantage_function_path`.
        data: The shard: `rewards`, `loss_masks` (tensors), and as available `log_probs`, `ref_log_probs`, `values`.
        process_group: Group to whiten over (default: the default group).
        device: Device the whitening all-reduce runs on (CUDA under NCCL).
    """
    custom = getattr(args, "custom_advantage_function_path", None)
    if custom:
        load_function(custom)(args, data)
        missing = [key for key in ("advantages", "returns") if data.get(key) is None]
        if missing:
            raise ValueError(f"--custom-advantage-function-path {custom} did not set {missing} in the rollout data")
    else:
        estimator = args.advantage_estimator
        rewards, masks = data["rewards"], data["loss_masks"]
        kl = reward_kl(args, data)
        if estimator in ("grpo", "gspo", "cispo"):
            advantages = returns = get_grpo_returns(rewards, kl)
        elif estimator == "reinforce_plus_plus":
            advantages = returns = get_reinforce_plus_plus_returns(rewards, kl, masks, args.kl_coef, args.gamma)
        elif estimator == "reinforce_plus_plus_baseline":
            advantages = returns = get_reinforce_plus_plus_baseline_advantages(rewards, kl, masks, args.kl_coef)
        elif estimator == "ppo":
            if data.get("values") is None:
                raise ValueError(
                    "--advantage-estimator ppo needs critic values; pass the critic's values to train (values_refs=)"
                )
            token_rewards = build_token_level_rewards(rewards, kl, masks, args.kl_coef)
            advantages, returns = get_advantages_and_returns_batch(
                data["values"], token_rewards, args.gamma, args.lambd
            )
        else:
            raise ValueError(f"unknown --advantage-estimator {estimator!r}")
        data["advantages"], data["returns"] = list(advantages), list(returns)

    if args.normalize_advantages:
        lengths = [a.numel() for a in data["advantages"]]
        flat = torch.cat(data["advantages"]).float().to(device)
        mask = torch.cat([m.float() for m in data["loss_masks"]]).to(device)
        whitened = distributed_masked_whiten(flat, mask, process_group=process_group).cpu()
        data["advantages"] = list(torch.split(whitened, lengths))
