"""Advantage estimators (`--advantage-estimator`) and the reward math behind them.

An estimator runs in two places. Its *group baseline*, `group_rewards(args, rewards) -> rewards` over a
`[num_prompts, n_samples_per_prompt]` tensor, runs where whole prompt groups are together (the rollout
manager, before the data is split over ranks). Its *estimator function* `fn(args, data) -> (advantages,
returns)` runs on each trainer rank on that rank's shard: per-sample lists of 1D tensors over the response
tokens, from `data["rewards"]` (after the baseline), `loss_masks`, `log_probs`, `ref_log_probs`, `values`.
Register your own:

    @register_advantage_estimator("my_adv", group_rewards=rloo_group_rewards)  # from this module
    def my_adv(args, data):
        returns = [torch.full(mask.shape, float(r)) for r, mask in zip(data["rewards"], data["loss_masks"])]
        return returns, returns
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime.algorithms.gae import chunked_discounted_returns, get_advantages_and_returns_batch
from slime.algorithms.kl import compute_approx_kl
from slime.algorithms.opd import apply_opd_kl_to_advantages
from slime.algorithms.registry import Registry, import_object, load_from_args, origin_of
from slime.algorithms.stats import distributed_masked_whiten

EstimatorFn = Callable[[Namespace, dict], tuple[list[torch.Tensor], list[torch.Tensor]]]
GroupRewardsFn = Callable[[Namespace, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator; see `register_advantage_estimator` for the fields."""

    fn: EstimatorFn
    group_rewards: GroupRewardsFn | None = None
    critic: bool = False
    whiten: bool = False
    policy_loss: str | None = None


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "--advantage-estimator")


def register_advantage_estimator(
    name: str,
    *,
    group_rewards: GroupRewardsFn | None = None,
    critic: bool = False,
    whiten: bool = False,
    policy_loss: str | None = None,
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator registering `fn(args, data) -> (advantages, returns)` as `--advantage-estimator name`.

    Args:
        name: The `--advantage-estimator` value.
        group_rewards: `f(args, rewards [num_prompts, n]) -> [num_prompts, n]`, the baseline applied per prompt
            group before training (skipped with `--disable-rewards-normalization`). An estimator with one needs
            `--n-samples-per-prompt` >= 2, which is checked at parse time.
        critic: The estimator needs critic values (`data["values"]`); a critic is trained alongside.
        whiten: Turns on `--normalize-advantages`.
        policy_loss: The policy loss `--loss-type policy_loss` means with this estimator (`gspo`, `cispo`).
    """

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        entry = AdvantageEstimator(fn, group_rewards, critic, whiten, policy_loss)
        ADVANTAGE_ESTIMATORS.add(name, entry, origin_of(fn))
        return fn

    return decorator


def get_estimator(args: Namespace) -> AdvantageEstimator:
    """The estimator `args.advantage_estimator` names (user modules of `--custom-algorithm-module` loaded first)."""
    load_from_args(args)
    return ADVANTAGE_ESTIMATORS.get(args.advantage_estimator)


# ---------------------------------------------------------------------------------------
# Group baselines (rollout side)
# ---------------------------------------------------------------------------------------


def normalize_group_rewards(
    rewards: torch.Tensor | list[float],
    n_samples_per_prompt: int,
    std_normalization: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative rewards (GRPO/GSPO/CISPO, and the REINFORCE++ baseline).

    Consecutive blocks of `n_samples_per_prompt` rewards form one group. Each reward has its group
    mean subtracted and, when `std_normalization` is on, is divided by `std + eps`, where std is the
    unbiased (Bessel-corrected, `torch.std` default) standard deviation of the group. A constant
    group, including any group of one sample, maps to exact zeros.

    Args:
        rewards (`torch.Tensor` or `list[float]`):
            Flat rewards, grouped by prompt, length a multiple of `n_samples_per_prompt`.
        n_samples_per_prompt (`int`):
            Group size.
        std_normalization (`bool`, *optional*, defaults to `True`):
            Divide by the group std (off with `--disable-grpo-std-normalization`).
        eps (`float`, *optional*, defaults to `1e-6`):
            Added to the std.

    Returns:
        `torch.Tensor`: Flat float32 normalized rewards.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if n_samples_per_prompt < 1 or rewards.numel() % n_samples_per_prompt != 0:
        raise ValueError(
            f"got {rewards.numel()} rewards, which do not split into groups of n_samples_per_prompt="
            f"{n_samples_per_prompt}; pass rewards grouped by prompt with a matching --n-samples-per-prompt"
        )
    groups = rewards.view(-1, n_samples_per_prompt)
    # The mean of equal floats can differ from them by an ulp; force constant groups to exact zeros.
    constant = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    centered = torch.where(constant, 0.0, groups - groups.mean(dim=1, keepdim=True))
    if std_normalization and n_samples_per_prompt > 1:
        centered = centered / (groups.std(dim=1, keepdim=True) + eps)
    return centered.flatten()


def leave_one_out_rewards(rewards: torch.Tensor | list[float], n_samples_per_prompt: int) -> torch.Tensor:
    """RLOO rewards: each reward minus the mean of the *other* rewards of its group.

    `r_i - (sum_j r_j - r_i) / (n - 1)`, i.e. `n / (n - 1)` times the GRPO mean-centered reward, which makes
    the baseline independent of the sample it corrects. Constant groups map to exact zeros.

    Args:
        rewards (`torch.Tensor` or `list[float]`):
            Flat rewards, grouped by prompt, length a multiple of `n_samples_per_prompt`.
        n_samples_per_prompt (`int`):
            Group size, at least 2.

    Returns:
        `torch.Tensor`: Flat float32 rewards.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if n_samples_per_prompt < 2 or rewards.numel() % n_samples_per_prompt != 0:
        raise ValueError(
            f"RLOO needs groups of at least 2 rewards, got {rewards.numel()} rewards in groups of "
            f"n_samples_per_prompt={n_samples_per_prompt}; pass --n-samples-per-prompt 2 or more"
        )
    groups = rewards.view(-1, n_samples_per_prompt)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (n_samples_per_prompt - 1)
    constant = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, 0.0, groups - others_mean).flatten()


def grpo_group_rewards(args: Namespace, rewards: torch.Tensor) -> torch.Tensor:
    """GRPO's baseline: subtract the group mean, divide by the group std (not with --disable-grpo-std-normalization)."""
    normalized = normalize_group_rewards(rewards.flatten(), rewards.shape[1], not args.disable_grpo_std_normalization)
    return normalized.view_as(rewards)


def mean_group_rewards(args: Namespace, rewards: torch.Tensor) -> torch.Tensor:
    """Subtract the group mean (REINFORCE++-baseline)."""
    return normalize_group_rewards(rewards.flatten(), rewards.shape[1], std_normalization=False).view_as(rewards)


def rloo_group_rewards(args: Namespace, rewards: torch.Tensor) -> torch.Tensor:
    """RLOO's leave-one-out baseline."""
    return leave_one_out_rewards(rewards.flatten(), rewards.shape[1]).view_as(rewards)


def group_baseline_rewards(args: Namespace, rewards: list[float]) -> list[float]:
    """The rewards the trainer sees: the estimator's group baseline applied per prompt group.

    Unchanged for estimators without one (ppo, reinforce_plus_plus) and with `--disable-rewards-normalization`.

    Args:
        args: `advantage_estimator`, `n_samples_per_prompt`, `disable_rewards_normalization` (and the flags the
            baseline reads, e.g. `disable_grpo_std_normalization`).
        rewards: One scalar per sample, `n_samples_per_prompt` consecutive samples per prompt.
    """
    estimator = get_estimator(args)
    if estimator.group_rewards is None or args.disable_rewards_normalization:
        return list(rewards)
    n = args.n_samples_per_prompt
    flat = torch.tensor(rewards, dtype=torch.float32)
    if n < 1 or flat.numel() % n:
        raise ValueError(
            f"got {flat.numel()} rewards, which do not split into groups of --n-samples-per-prompt {n}; "
            "a rollout function must return every prompt's samples together"
        )
    return estimator.group_rewards(args, flat.view(-1, n)).flatten().tolist()


# ---------------------------------------------------------------------------------------
# Per-sample returns (trainer side)
# ---------------------------------------------------------------------------------------


def get_grpo_returns(rewards: torch.Tensor | list[float], kl: list[torch.Tensor]) -> list[torch.Tensor]:
    """GRPO returns: each sample's (already normalized) reward on every response token.

    Args:
        rewards (`torch.Tensor` or `list[float]`):
            One scalar per sample.
        kl (`list[torch.Tensor]`):
            Per-sample tensors whose shapes (and dtype/device) the returns take.

    Returns:
        `list[torch.Tensor]`: Per-sample returns.
    """
    return [torch.ones_like(sample_kl) * reward for reward, sample_kl in zip(rewards, kl, strict=True)]


def build_token_level_rewards(
    rewards: torch.Tensor | list[float],
    kl: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    kl_coef: float,
) -> list[torch.Tensor]:
    """Per-token rewards for REINFORCE++ and PPO: `-kl_coef * kl` on trainable tokens, plus the
    sample's scalar reward on its last trainable token. Masked-out tokens get 0.

    Args:
        rewards (`torch.Tensor` or `list[float]`):
            One scalar per sample.
        kl (`list[torch.Tensor]`):
            Per-sample per-token KL to the reference (zeros when `kl_coef` is 0).
        loss_masks (`list[torch.Tensor]`):
            Per-sample response loss masks.
        kl_coef (`float`):
            Weight of the KL penalty (`--kl-coef`).

    Returns:
        `list[torch.Tensor]`: Per-sample token rewards.
    """
    token_rewards = []
    for index, (reward, sample_kl, loss_mask) in enumerate(zip(rewards, kl, loss_masks, strict=True)):
        trainable = loss_mask.nonzero().flatten()
        if trainable.numel() == 0:
            raise ValueError(
                f"sample {index} has an all-zero loss mask, so there is no token to carry its reward; "
                "drop such samples before computing advantages"
            )
        token_reward = -kl_coef * sample_kl * loss_mask.to(sample_kl.dtype)
        token_reward[trainable[-1]] += float(reward)
        token_rewards.append(token_reward)
    return token_rewards


def get_reinforce_plus_plus_returns(
    rewards: torch.Tensor | list[float],
    kl: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    kl_coef: float,
    gamma: float,
) -> list[torch.Tensor]:
    """REINFORCE++ returns `G_t = r_t + gamma * G_{t+1}` per sample.

    Token rewards come from `build_token_level_rewards`. Discounting runs over every response
    position, masked or not: a masked-out span (e.g. a tool's output in a multi-turn sample) adds
    no reward, but its positions still count as time steps, so the chain is never cut. Upstream's
    `response_lengths` / `total_lengths` arguments only served context-parallel slicing and are
    not taken here.

    Args:
        rewards (`torch.Tensor` or `list[float]`):
            One scalar per sample.
        kl (`list[torch.Tensor]`):
            Per-sample per-token KL to the reference.
        loss_masks (`list[torch.Tensor]`):
            Per-sample response loss masks.
        kl_coef (`float`):
            Weight of the per-token KL penalty.
        gamma (`float`):
            Discount factor.

    Returns:
        `list[torch.Tensor]`: Per-sample returns.
    """
    token_rewards = build_token_level_rewards(rewards, kl, loss_masks, kl_coef)
    lengths = [t.numel() for t in token_rewards]
    padded = torch.nn.utils.rnn.pad_sequence(token_rewards, batch_first=True)
    returns = chunked_discounted_returns(padded, gamma)
    return [row[:length] for row, length in zip(returns, lengths, strict=True)]


def get_reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor | list[float],
    kl: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    kl_coef: float,
) -> list[torch.Tensor]:
    """REINFORCE++-baseline advantages (before whitening): `reward - kl_coef * kl` on every token.

    The rewards are expected to have their group mean subtracted already. The KL term is applied on
    trainable tokens only, like in `build_token_level_rewards`.

    Args:
        rewards (`torch.Tensor` or `list[float]`):
            One baseline-subtracted scalar per sample.
        kl (`list[torch.Tensor]`):
            Per-sample per-token KL to the reference.
        loss_masks (`list[torch.Tensor]`):
            Per-sample response loss masks.
        kl_coef (`float`):
            Weight of the per-token KL penalty.

    Returns:
        `list[torch.Tensor]`: Per-sample advantages.
    """
    return [
        torch.ones_like(sample_kl) * reward - kl_coef * sample_kl * loss_mask.to(sample_kl.dtype)
        for reward, sample_kl, loss_mask in zip(rewards, kl, loss_masks, strict=True)
    ]


def reward_kl(args: Namespace, data: dict) -> list[torch.Tensor]:
    """Per-token KL of the sampling policy to the reference (`--kl-loss-type` estimator), zeros without a reference."""
    if data.get("ref_log_probs") is None:
        return [torch.zeros(mask.shape, dtype=torch.float32) for mask in data["loss_masks"]]
    return [
        compute_approx_kl(log_probs, ref_log_probs, args.kl_loss_type)
        for log_probs, ref_log_probs in zip(data["log_probs"], data["ref_log_probs"], strict=True)
    ]


# ---------------------------------------------------------------------------------------
# Registered estimators
# ---------------------------------------------------------------------------------------


# Decorators apply bottom-up: grpo registers first, so it leads the --advantage-estimator choices.
@register_advantage_estimator("rloo", group_rewards=rloo_group_rewards)
@register_advantage_estimator("cispo", group_rewards=grpo_group_rewards, policy_loss="cispo")
@register_advantage_estimator("gspo", group_rewards=grpo_group_rewards, policy_loss="gspo")
@register_advantage_estimator("grpo", group_rewards=grpo_group_rewards)
def outcome_advantages(args: Namespace, data: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The sample's (group-baselined) reward on every response token."""
    returns = get_grpo_returns(data["rewards"], reward_kl(args, data))
    return returns, returns


@register_advantage_estimator("reinforce_plus_plus", whiten=True)
def reinforce_plus_plus_advantages(args: Namespace, data: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Discounted returns of the token rewards (`-kl_coef * kl`, the reward on the last trainable token)."""
    returns = get_reinforce_plus_plus_returns(
        data["rewards"], reward_kl(args, data), data["loss_masks"], args.kl_coef, args.gamma
    )
    return returns, returns


@register_advantage_estimator("reinforce_plus_plus_baseline", group_rewards=mean_group_rewards, whiten=True)
def reinforce_plus_plus_baseline_advantages(
    args: Namespace, data: dict
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The mean-baselined reward minus `kl_coef * kl` on every token."""
    advantages = get_reinforce_plus_plus_baseline_advantages(
        data["rewards"], reward_kl(args, data), data["loss_masks"], args.kl_coef
    )
    return advantages, advantages


@register_advantage_estimator("ppo", critic=True)
def ppo_advantages(args: Namespace, data: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE (`--gamma`, `--lambd`) over the token rewards with the critic's `data["values"]`."""
    if data.get("values") is None:
        raise ValueError(
            "--advantage-estimator ppo needs critic values; pass the critic's values to train (values_refs=)"
        )
    token_rewards = build_token_level_rewards(data["rewards"], reward_kl(args, data), data["loss_masks"], args.kl_coef)
    return get_advantages_and_returns_batch(data["values"], token_rewards, args.gamma, args.lambd)


def compute_advantages_and_returns(
    args: Namespace,
    data: dict,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> None:
    """Set `data["advantages"]` and `data["returns"]` for this rank's samples, in place.

    Runs the `--advantage-estimator` function, or `--custom-advantage-function-path` `f(args, data)`, which
    replaces it and must set both keys. `--use-opd` then subtracts the teacher term (`slime.algorithms.opd`; the
    per-token reverse-KL estimates go to `data["opd_reverse_kl"]`), and `--normalize-advantages` whitens the
    advantages over the trainable tokens of every data-parallel rank (a collective: every rank must call this).

    Args:
        args: `advantage_estimator` and the flags it reads (`kl_coef`, `kl_loss_type`, `gamma`, `lambd`),
            `normalize_advantages`, `custom_advantage_function_path`, `custom_algorithm_module`, `use_opd`,
            `opd_kl_coef`.
        data: The shard: `rewards`, `loss_masks` (tensors), and as available `log_probs`, `ref_log_probs`, `values`,
            `teacher_log_probs` (tensors; needed with `use_opd`, with `log_probs`).
        process_group: Group to whiten over (default: the default group).
        device: Device the whitening all-reduce runs on (CUDA under NCCL).
    """
    custom = args.custom_advantage_function_path
    if custom:
        import_object(custom, "--custom-advantage-function-path")(args, data)
        missing = [key for key in ("advantages", "returns") if data.get(key) is None]
        if missing:
            raise ValueError(f"--custom-advantage-function-path {custom} did not set {missing} in the rollout data")
    else:
        advantages, returns = get_estimator(args).fn(args, data)
        num_samples = len(data["loss_masks"])
        if len(advantages) != num_samples or len(returns) != num_samples:
            raise ValueError(
                f"--advantage-estimator {args.advantage_estimator} returned {len(advantages)} advantages and "
                f"{len(returns)} returns for {num_samples} samples; return one 1D tensor per sample for each"
            )
        data["advantages"], data["returns"] = list(advantages), list(returns)

    # The critic has no log-probs and reads only the returns, which the teacher term leaves alone (as upstream).
    if args.use_opd and data.get("log_probs") is not None:
        if data.get("teacher_log_probs") is None:
            raise ValueError("--use-opd needs teacher_log_probs in the rollout data (Sample.teacher_log_probs)")
        data["advantages"], data["opd_reverse_kl"] = apply_opd_kl_to_advantages(
            data["advantages"], data["log_probs"], data["teacher_log_probs"], args.opd_kl_coef
        )

    if args.normalize_advantages:
        lengths = [a.numel() for a in data["advantages"]]
        flat = torch.cat(data["advantages"]).float().to(device)
        mask = torch.cat([m.float() for m in data["loss_masks"]]).to(device)
        whitened = distributed_masked_whiten(flat, mask, process_group=process_group).cpu()
        data["advantages"] = list(torch.split(whitened, lengths))
