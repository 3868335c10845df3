"""RL math for slime as pure tensor functions: KL estimators, policy/value/SFT losses,
advantage estimators (GRPO, REINFORCE++, GAE), importance weights and loss aggregation.

Conventions used throughout:

- A *sample* is one response. Per-sample quantities are 1D tensors over the response
  tokens (length `response_length`) and come in Python lists, one entry per sample.
- `loss_masks` are 0/1 tensors (any dtype) over the same response tokens; 1 = trainable.
- `ppo_kl = old_log_probs - log_probs`, so the PPO ratio pi/pi_old is `exp(-ppo_kl)`.
- Nothing here talks to a model, a backend or a process group (except the optional
  all-reduce in `distributed_masked_whiten`), so both trainers share it unchanged.
"""

from __future__ import annotations

import math
from argparse import Namespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Log-weights are clamped to this range before exp() so that a wild log-ratio gives a large
# but finite weight (and finite gradients) instead of inf; every bound used in practice lies
# far inside [e^-20, e^20], so clamping never changes which tokens are clipped or masked.
_LOG_WEIGHT_LIMIT = 20.0


# ---------------------------------------------------------------------------------------
# KL estimators and per-token policy losses
# ---------------------------------------------------------------------------------------


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_loss_type: str,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_base) from tokens sampled from pi.

    With `log_ratio = log_probs - log_probs_base` (i.e. log pi/pi_base):

    - `"k1"`: `log_ratio` (unbiased, high variance, can be negative);
    - `"k2"`: `log_ratio**2 / 2` (biased, low variance);
    - `"k3"`: `exp(-log_ratio) - 1 + log_ratio` (unbiased and always >= 0; Schulman's estimator
      `r - 1 - log r` with `r = pi_base / pi`);
    - `"low_var_kl"`: `k3` clamped to `[-10, 10]`.

    Args:
        log_probs (`torch.Tensor`):
            Log-probabilities of the sampled tokens under the current policy pi.
        log_probs_base (`torch.Tensor`):
            Log-probabilities of the same tokens under the base policy (usually the reference model).
        kl_loss_type (`str`):
            One of `"k1"`, `"k2"`, `"k3"`, `"low_var_kl"`.
        importance_ratio (`torch.Tensor`, *optional*):
            Per-token weight multiplied into the estimate before clamping, e.g. pi/pi_old when the
            tokens were sampled from an older policy (`--use-unbiased-kl`).

    Returns:
        `torch.Tensor`: Per-token KL estimate, float32, same shape as the inputs.
    """
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio.pow(2) / 2
    elif kl_loss_type in ("k3", "low_var_kl"):
        if kl_loss_type == "low_var_kl":
            # Beyond |log_ratio| = 20 the clamped value is 10 either way; clamping here keeps
            # exp() finite so the backward pass yields zeros instead of 0 * inf = nan.
            log_ratio = log_ratio.clamp(-_LOG_WEIGHT_LIMIT, _LOG_WEIGHT_LIMIT)
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; use one of 'k1', 'k2', 'k3', 'low_var_kl'")

    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = kl.clamp(-10, 10)
    return kl


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss per token, with optional dual clip.

    `ratio = exp(-ppo_kl)`; the loss is `max(-A * ratio, -A * clamp(ratio, 1 - eps_clip, 1 + eps_clip_high))`.
    With `eps_clip_c`, tokens with a negative advantage are additionally bounded by `-A * eps_clip_c`,
    so a huge ratio on a bad token cannot blow up the loss (dual-clip PPO).

    Args:
        ppo_kl (`torch.Tensor`):
            `old_log_probs - log_probs` per token.
        advantages (`torch.Tensor`):
            Advantage per token, same shape as `ppo_kl`.
        eps_clip (`float`):
            Lower clip range: the ratio is clipped below at `1 - eps_clip`.
        eps_clip_high (`float`):
            Upper clip range: the ratio is clipped above at `1 + eps_clip_high`.
        eps_clip_c (`float`, *optional*):
            Dual-clip constant, must be > 1.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: per-token losses, and per-token clip indicator (float 0/1,
        1 where the clipped term of the standard PPO objective is the active one).
    """
    ratio = torch.exp(-ppo_kl)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    pg_losses = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()

    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(
                f"eps_clip_c must be > 1 for dual-clip PPO, got {eps_clip_c}; raise --eps-clip-c or unset it"
            )
        dual_bound = -advantages * eps_clip_c
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, dual_bound), pg_losses)

    return pg_losses, clipfrac


def compute_gspo_kl(
    log_probs: list[torch.Tensor],
    old_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
) -> torch.Tensor:
    """Sequence-level `ppo_kl` for GSPO, broadcast to every token of each sample.

    Each sample's value is the masked mean of `old_log_probs - log_probs`, so `exp(-ppo_kl)` is the
    geometric-mean sequence ratio of GSPO. Gradients use the straight-through form
    `seq_kl.detach() + (token_kl - token_kl.detach())`: the forward value is the sequence one, while
    each token's gradient comes from its own log-prob (GSPO-token). With one advantage per sequence
    and per-sample mean aggregation this is exactly GSPO's gradient, and it stays well defined when
    advantages differ per token.

    Unlike upstream's four-argument version there is no separate "local" list: context-parallel
    callers gather the full responses first.

    Args:
        log_probs (`list[torch.Tensor]`):
            Current-policy log-probs per sample, 1D over response tokens.
        old_log_probs (`list[torch.Tensor]`):
            Log-probs under the policy that generated the data, same shapes.
        loss_masks (`list[torch.Tensor]`):
            Response-token loss masks, same shapes.

    Returns:
        `torch.Tensor`: 1D concatenation over samples of the per-token `ppo_kl`, ready for
        `compute_policy_loss`.
    """
    per_sample = []
    for log_prob, old_log_prob, loss_mask in zip(log_probs, old_log_probs, loss_masks, strict=True):
        mask = loss_mask.to(log_prob.dtype)
        token_kl = old_log_prob - log_prob
        seq_kl = (token_kl * mask).sum() / mask.sum().clamp_min(1)
        per_sample.append(seq_kl.detach() + (token_kl - token_kl.detach()))
    return torch.cat(per_sample)


def compute_cispo_loss(
    ppo_kl: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO loss per token: `-stopgrad(min(ratio, 1 + eps_clip_high)) * A * log_probs`.

    The importance ratio is truncated and detached, so every token keeps a REINFORCE-style gradient
    (no token is dropped by clipping, unlike PPO).

    Args:
        ppo_kl (`torch.Tensor`):
            `old_log_probs - log_probs` per token.
        log_probs (`torch.Tensor`):
            Current-policy log-probs per token (carries the gradient).
        advantages (`torch.Tensor`):
            Advantage per token.
        eps_clip_high (`float`):
            The ratio is capped at `1 + eps_clip_high`.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: per-token losses, and a float 0/1 indicator of tokens whose
        ratio was capped.
    """
    ratio = torch.exp(-ppo_kl)
    capped_ratio = ratio.clamp(max=1 + eps_clip_high).detach()
    pg_losses = -capped_ratio * advantages * log_probs
    clipfrac = (ratio > 1 + eps_clip_high).float()
    return pg_losses, clipfrac


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token: `0.5 * max((v - R)^2, (v_clipped - R)^2)`.

    `v_clipped = old_values + clamp(values - old_values, -value_clip, value_clip)`.

    Args:
        values (`torch.Tensor`):
            Current critic outputs per token.
        old_values (`torch.Tensor`):
            Critic outputs when the data was generated.
        returns (`torch.Tensor`):
            Return targets per token.
        value_clip (`float`):
            Largest allowed move of the value away from `old_values`.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: per-token losses, and a float 0/1 indicator of tokens where
        the clipped term is the larger one.
    """
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped_error = (values - returns).pow(2)
    clipped_error = (clipped_values - returns).pow(2)
    loss = 0.5 * torch.maximum(unclipped_error, clipped_error)
    clipfrac = (clipped_error > unclipped_error).float()
    return loss, clipfrac


# ---------------------------------------------------------------------------------------
# Log-probs and entropy from logits
# ---------------------------------------------------------------------------------------


def compute_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token) under `softmax(logits / temperature)`, computed in float32.

    Args:
        logits (`torch.Tensor`):
            `[..., vocab]` logits; position `i` must be the prediction for `tokens[..., i]`.
        tokens (`torch.Tensor`):
            `[...]` token ids.
        temperature (`float`, *optional*, defaults to `1.0`):
            The rollout sampling temperature, so the log-probs match what the engine sampled from.

    Returns:
        `torch.Tensor`: `[...]` float32 log-probabilities.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to define log-probs, got {temperature}; check --rollout-temperature")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # Equal to log_softmax(...).gather(...), without materialising a second [..., vocab] tensor.
    token_logits = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return token_logits - torch.logsumexp(logits, dim=-1)


def compute_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy `-sum_v p_v log p_v` of `softmax(logits)` over the last dim, in float32.

    Uses `log_softmax` for stability. Vocabulary entries with probability 0 (e.g. logits set to -inf
    by top-p/top-k masking) contribute exactly 0, in the forward and the backward pass.

    Args:
        logits (`torch.Tensor`):
            `[..., vocab]` logits.

    Returns:
        `torch.Tensor`: `[...]` entropies.
    """
    log_p = F.log_softmax(logits.float(), dim=-1)
    p = log_p.exp()
    # 0 * -inf would be nan; zero the log first so the product (and its gradient) is 0 there.
    log_p = log_p.masked_fill(p == 0, 0.0)
    return -(p * log_p).sum(dim=-1)


# ---------------------------------------------------------------------------------------
# Rewards and advantage estimators
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


# ---------------------------------------------------------------------------------------
# GAE and discounted sums
# ---------------------------------------------------------------------------------------


def _td_errors(rewards: torch.Tensor, values: torch.Tensor, gamma: float) -> torch.Tensor:
    """delta_t = r_t + gamma * V_{t+1} - V_t, with V_T = 0 after the last position."""
    if rewards.ndim != 2 or rewards.shape != values.shape:
        raise ValueError(
            f"GAE expects rewards and values of the same [batch, time] shape, got {tuple(rewards.shape)} "
            f"and {tuple(values.shape)}; pad per-sample tensors (see get_advantages_and_returns_batch)"
        )
    rewards, values = rewards.detach(), values.detach()
    deltas = rewards - values
    deltas[:, :-1].add_(values[:, 1:], alpha=gamma)
    return deltas


def vanilla_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation by the textbook reverse recursion over time.

    `A_t = delta_t + gamma * lambd * A_{t+1}`, `delta_t = r_t + gamma * V_{t+1} - V_t`, `V_T = 0`.
    Vectorized over the batch, one Python step per position: the reference for `chunked_gae`.

    Args:
        rewards (`torch.Tensor`):
            `[B, T]` per-token rewards (zeros past each sample's end).
        values (`torch.Tensor`):
            `[B, T]` critic values (zeros past each sample's end).
        gamma (`float`):
            Discount factor.
        lambd (`float`):
            GAE lambda.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: `[B, T]` advantages and returns (= advantages + values), without
        gradient (they are targets).
    """
    deltas = _td_errors(rewards, values, gamma).t().contiguous()  # [T, B]: each step reads one contiguous row
    decay = gamma * lambd
    advantages = deltas.new_zeros(deltas.shape[0] + 1, deltas.shape[1])  # extra zero row: A_T = 0
    for t in reversed(range(deltas.shape[0])):
        torch.add(deltas[t], advantages[t + 1], alpha=decay, out=advantages[t])
    advantages = advantages[:-1].t().contiguous()
    return advantages, advantages + values.detach()


def _discounted_suffix_sum(x: torch.Tensor, factor: float, chunk_size: int) -> torch.Tensor:
    """y[:, t] = sum_{k >= 0} factor^k * x[:, t + k] for a [B, T] tensor, as a chunked parallel scan.

    Within each chunk of C positions the local suffix sums are one matmul with the upper-triangular
    matrix K[j, i] = factor^(j - i) (j >= i). Only powers 0..C appear, and they only shrink, so
    nothing overflows; for tiny factors they underflow to 0, which is where their true contribution
    is below float precision anyway. The sums entering each chunk from the right obey the same
    recursion with factor^C over the chunk heads, so they are solved by the same function,
    recursively, instead of a Python loop over chunks.

    The scan accumulates in float64 and rounds once at the end: a float32 matmul sums up to C terms
    at full magnitude (error ~ sqrt(C) ulp), while the sequential recursion damps each rounding by
    the factor; float64 keeps the two within 1e-5 of each other at 256 x 131072.
    """
    batch, length = x.shape
    n_chunks = -(-length // chunk_size)
    padded = x.new_zeros(batch, n_chunks * chunk_size, dtype=torch.float64)
    padded[:, :length] = x
    chunks = padded.view(batch, n_chunks, chunk_size)

    steps = torch.arange(chunk_size, device=x.device)
    gap = steps[:, None] - steps[None, :]  # gap[j, i] = j - i
    base = torch.tensor(factor, dtype=torch.float64, device=x.device)
    kernel = torch.where(gap >= 0, base.pow(gap.clamp(min=0)), 0.0)
    local = chunks @ kernel  # local[b, n, i] = sum_{j >= i in chunk n} factor^(j - i) x[b, n, j]

    if n_chunks > 1:
        # heads[b, n] = y at the first position of chunk n = suffix sum over the chunk heads.
        heads = _discounted_suffix_sum(local[:, :, 0], factor**chunk_size, chunk_size)
        incoming = F.pad(heads[:, 1:], (0, 1))  # y right after chunk n (0 after the last one)
        decay_to_end = base.pow(torch.arange(chunk_size, 0, -1, device=x.device))  # factor^(C - i)
        local.addcmul_(incoming[:, :, None], decay_to_end)
    return local.view(batch, n_chunks * chunk_size)[:, :length].to(x.dtype)


def chunked_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lambd: float,
    chunk_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE as a chunked parallel scan: same result as `vanilla_gae`, without a loop over time.

    Advantages are the discounted suffix sums of the TD errors with factor `gamma * lambd`; see
    `_discounted_suffix_sum` for the scheme. Work is O(B * T * chunk_size) in matmuls and the
    sequential depth is O(log_chunk_size T).

    Args:
        rewards (`torch.Tensor`):
            `[B, T]` per-token rewards (zeros past each sample's end).
        values (`torch.Tensor`):
            `[B, T]` critic values (zeros past each sample's end).
        gamma (`float`):
            Discount factor.
        lambd (`float`):
            GAE lambda.
        chunk_size (`int`, *optional*, defaults to `128`):
            Positions per chunk; 64-256 suits both CPU and GPU.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: `[B, T]` advantages and returns (= advantages + values), without
        gradient (they are targets).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    advantages = _discounted_suffix_sum(_td_errors(rewards, values, gamma), gamma * lambd, chunk_size)
    return advantages, advantages + values.detach()


def chunked_discounted_returns(rewards: torch.Tensor, gamma: float, chunk_size: int = 128) -> torch.Tensor:
    """Discounted returns `G_t = r_t + gamma * G_{t+1}` (G_T = 0) of `[B, T]` rewards, by chunked scan.

    Args:
        rewards (`torch.Tensor`):
            `[B, T]` per-token rewards (zeros past each sample's end).
        gamma (`float`):
            Discount factor.
        chunk_size (`int`, *optional*, defaults to `128`):
            Positions per chunk.

    Returns:
        `torch.Tensor`: `[B, T]` returns.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [batch, time], got shape {tuple(rewards.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _discounted_suffix_sum(rewards, gamma, chunk_size)


def get_advantages_and_returns_batch(
    values_list: list[torch.Tensor],
    rewards_list: list[torch.Tensor],
    gamma: float,
    lambd: float,
    chunked: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over per-sample 1D tensors of different lengths.

    Samples are right-padded with zeros into one `[B, T_max]` batch. That is exact: padding has zero
    reward and value, so the value after each sample's last token is 0, and padded TD errors are 0.

    Args:
        values_list (`list[torch.Tensor]`):
            Per-sample critic values over response tokens.
        rewards_list (`list[torch.Tensor]`):
            Per-sample token rewards (see `build_token_level_rewards`), same lengths.
        gamma (`float`):
            Discount factor.
        lambd (`float`):
            GAE lambda.
        chunked (`bool`, *optional*, defaults to `True`):
            Use `chunked_gae`; `False` uses `vanilla_gae`.

    Returns:
        `tuple[list[torch.Tensor], list[torch.Tensor]]`: per-sample advantages and returns (no grad).
    """
    lengths = [v.numel() for v in values_list]
    if lengths != [r.numel() for r in rewards_list]:
        raise ValueError("values_list and rewards_list must hold tensors of the same lengths, sample by sample")
    with torch.no_grad():
        values = torch.nn.utils.rnn.pad_sequence(values_list, batch_first=True)
        rewards = torch.nn.utils.rnn.pad_sequence(rewards_list, batch_first=True).to(values.dtype)
        gae = chunked_gae if chunked else vanilla_gae
        advantages, returns = gae(rewards, values, gamma, lambd)
    return (
        [row[:n] for row, n in zip(advantages, lengths, strict=True)],
        [row[:n] for row, n in zip(returns, lengths, strict=True)],
    )


# ---------------------------------------------------------------------------------------
# Importance weights for train/inference mismatch (TIS / MIS)
# ---------------------------------------------------------------------------------------


def compute_is_weights(
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    *,
    level: str = "token",
    mode: str = "truncate",
    lower: float | None = None,
    upper: float = 2.0,
    veto_threshold: float | None = None,
    batch_normalize: bool = False,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Importance weights pi_train / pi_rollout correcting for the inference engine's mismatch.

    Per-token log-ratio `train_log_probs - rollout_log_probs`, aggregated by `level`:

    - `"token"`: each token its own ratio;
    - `"sequence"`: product of the ratios over trainable tokens (a sum in log space), on every token;
    - `"geometric"`: `exp(mean log-ratio)` over trainable tokens, on every token.

    then bounded by `mode`:

    - `"truncate"`: `min(w, upper)` (TIS; `lower` unused);
    - `"mask"`: `w` where `lower <= w <= upper`, else 0 (MIS);
    - `"clip"`: `clamp(w, lower, upper)`.

    With `veto_threshold`, a sample in which any trainable token has ratio `< veto_threshold` gets all
    weights 0. With `batch_normalize`, weights are rescaled so their mean over all trainable tokens
    of the batch is 1 (left as they are if that mean is 0). Log-weights are clamped to [-20, 20]
    before exp. Weights carry no gradient.

    Args:
        train_log_probs (`list[torch.Tensor]`):
            Per-sample log-probs from the trainer (the policy the loss treats as "old").
        rollout_log_probs (`list[torch.Tensor]`):
            Per-sample log-probs reported by the inference engine.
        loss_masks (`list[torch.Tensor]`):
            Per-sample response loss masks.
        level (`str`, *optional*, defaults to `"token"`):
            `"token"`, `"sequence"` or `"geometric"`.
        mode (`str`, *optional*, defaults to `"truncate"`):
            `"truncate"`, `"mask"` or `"clip"`.
        lower (`float`, *optional*):
            Lower bound for `"mask"` / `"clip"`; defaults to `1 / upper`.
        upper (`float`, *optional*, defaults to `2.0`):
            Upper bound.
        veto_threshold (`float`, *optional*):
            Per-token ratio below which the whole sample is rejected.
        batch_normalize (`bool`, *optional*, defaults to `False`):
            Rescale to a masked mean of 1.

    Returns:
        `tuple[list[torch.Tensor], dict[str, torch.Tensor]]`: per-sample float32 weights, and 0-d metrics:
        `is_raw_weight_mean` (masked mean before bounding), `is_clipfrac` (fraction of trainable tokens
        whose weight the mode changed), `is_veto_fraction` (fraction of samples vetoed) and
        `is_weight_mean` (masked mean of the returned weights).
    """
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"unknown IS level {level!r}; use 'token', 'sequence' or 'geometric'")
    if mode not in ("truncate", "mask", "clip"):
        raise ValueError(f"unknown IS mode {mode!r}; use 'truncate', 'mask' or 'clip'")
    if upper <= 0:
        raise ValueError(f"IS upper bound must be > 0, got {upper}")
    if lower is None:
        lower = 1.0 / upper
    if not 0 <= lower <= upper:
        raise ValueError(f"IS bounds must satisfy 0 <= lower <= upper, got lower={lower}, upper={upper}")
    if veto_threshold is not None and veto_threshold <= 0:
        raise ValueError(f"veto_threshold must be > 0 (a ratio), got {veto_threshold}; unset it to disable the veto")

    weights, raw_weights, bounded, masks, vetoed = [], [], [], [], []
    for train_lp, rollout_lp, loss_mask in zip(train_log_probs, rollout_log_probs, loss_masks, strict=True):
        log_ratio = train_lp.detach().float() - rollout_lp.detach().float()
        mask = loss_mask.to(log_ratio.device, torch.float32)
        if level == "token":
            log_weight = log_ratio
        else:
            seq_log_ratio = (log_ratio * mask).sum()
            if level == "geometric":
                seq_log_ratio = seq_log_ratio / mask.sum().clamp_min(1)
            log_weight = seq_log_ratio.expand_as(log_ratio)
        raw = torch.exp(log_weight.clamp(-_LOG_WEIGHT_LIMIT, _LOG_WEIGHT_LIMIT))

        if mode == "truncate":
            weight = raw.clamp(max=upper)
        elif mode == "clip":
            weight = raw.clamp(lower, upper)
        else:
            weight = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
        bounded.append((weight != raw).float())

        is_vetoed = torch.zeros((), dtype=torch.bool, device=log_ratio.device)
        if veto_threshold is not None:
            is_vetoed = ((log_ratio < math.log(veto_threshold)) & (mask > 0)).any()
            weight = torch.where(is_vetoed, 0.0, weight)

        weights.append(weight)
        raw_weights.append(raw)
        masks.append(mask)
        vetoed.append(is_vetoed)

    all_mask = torch.cat(masks)
    token_count = all_mask.sum().clamp_min(1)
    all_raw = torch.cat(raw_weights)
    all_weights = torch.cat(weights)
    if batch_normalize:
        weight_mean = (all_weights * all_mask).sum() / token_count
        scale = torch.where(weight_mean > 0, 1 / weight_mean.clamp_min(torch.finfo(torch.float32).tiny), 1.0)
        weights = [w * scale for w in weights]
        all_weights = all_weights * scale

    metrics = {
        "is_raw_weight_mean": (all_raw * all_mask).sum() / token_count,
        "is_clipfrac": (torch.cat(bounded) * all_mask).sum() / token_count,
        "is_veto_fraction": torch.stack(vetoed).float().mean(),
        "is_weight_mean": (all_weights * all_mask).sum() / token_count,
    }
    return weights, metrics


def vanilla_tis_function(
    args: Namespace,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Truncated importance sampling for `--use-tis`: scale each token's policy loss by
    `clamp(exp(train - rollout), args.tis_clip_low, args.tis_clip)`.

    Has the `--custom-tis-function-path` signature, so it is also the template for user variants;
    extra keyword arguments (`total_lengths`, `response_lengths`) are accepted and unused.

    Args:
        args (`Namespace`):
            Needs `tis_clip` (upper bound) and `tis_clip_low` (lower bound).
        pg_loss (`torch.Tensor`):
            1D per-token policy loss, the concatenation of the samples in order.
        train_log_probs (`list[torch.Tensor]`):
            Per-sample log-probs from the trainer.
        rollout_log_probs (`list[torch.Tensor]`):
            Per-sample log-probs from the inference engine.
        loss_masks (`list[torch.Tensor]`):
            Per-sample response loss masks.

    Returns:
        `tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]`: the weighted per-token loss,
        the loss masks (unchanged), and the metrics of `compute_is_weights` renamed to `tis_*`.
    """
    weights, metrics = compute_is_weights(
        train_log_probs,
        rollout_log_probs,
        loss_masks,
        level="token",
        mode="clip",
        lower=args.tis_clip_low,
        upper=args.tis_clip,
    )
    weighted = pg_loss * torch.cat(weights).to(pg_loss.dtype)
    return weighted, loss_masks, {"tis" + name.removeprefix("is"): value for name, value in metrics.items()}


# ---------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (over `dim`, or everything); 0 where the mask is empty.

    Args:
        values (`torch.Tensor`):
            Values to average.
        mask (`torch.Tensor`):
            0/1 mask broadcastable to `values`.
        dim (`int`, *optional*):
            Dimension to reduce; all dimensions when `None`.

    Returns:
        `torch.Tensor`: The masked mean.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1e-8)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten `values` with the mean and (population, i.e. biased) variance of the masked entries.

    Args:
        values (`torch.Tensor`):
            Values to whiten (typically all advantages of a batch, concatenated).
        mask (`torch.Tensor`):
            0/1 mask, same shape.
        shift_mean (`bool`, *optional*, defaults to `True`):
            If `False`, the mean is added back, so only the scale changes.

    Returns:
        `torch.Tensor`: `(values - mean) / sqrt(var + 1e-8)` (plus `mean` if not `shift_mean`), computed
        on every entry; masked-out entries are transformed too but did not enter the statistics.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean).pow(2), mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def distributed_masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """`masked_whiten` with the statistics summed over all ranks of `process_group` (e.g. DP x CP).

    Falls back to `masked_whiten` when torch.distributed is not initialized. Every rank must call it.

    Args:
        values (`torch.Tensor`):
            This rank's values.
        mask (`torch.Tensor`):
            This rank's 0/1 mask, same shape.
        shift_mean (`bool`, *optional*, defaults to `True`):
            If `False`, the global mean is added back.
        process_group (`dist.ProcessGroup`, *optional*):
            Group to reduce over; the default group when `None`.

    Returns:
        `torch.Tensor`: This rank's whitened values, using global mean and variance.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return masked_whiten(values, mask, shift_mean)
    mask = mask.to(values.dtype)
    totals = torch.stack([(values * mask).sum(), mask.sum()])
    dist.all_reduce(totals, group=process_group)
    count = totals[1].clamp_min(1e-8)
    mean = totals[0] / count
    squared_error = ((values - mean).pow(2) * mask).sum()
    dist.all_reduce(squared_error, group=process_group)
    whitened = (values - mean) * torch.rsqrt(squared_error / count + 1e-8)
    return whitened if shift_mean else whitened + mean


# ---------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------


def sum_of_sample_mean(
    per_token_losses: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    num_samples: int | None = None,
) -> torch.Tensor:
    """Sum over samples of each sample's masked token mean, divided by `num_samples`.

    With the default `num_samples` (the number of samples given) this is the mean over samples of
    the per-sample mean, so short and long responses weigh the same. Trainers that accumulate
    gradients over micro-batches pass the sample count of the whole step instead, so that the
    micro-batch losses add up to the step's mean. A sample with an empty mask contributes 0.

    Args:
        per_token_losses (`list[torch.Tensor]`):
            Per-sample 1D per-token losses.
        loss_masks (`list[torch.Tensor]`):
            Per-sample loss masks, same shapes.
        num_samples (`int`, *optional*):
            Denominator; defaults to `len(per_token_losses)`.

    Returns:
        `torch.Tensor`: Scalar loss.
    """
    if not per_token_losses:
        raise ValueError("sum_of_sample_mean got no samples")
    sample_means = [
        (loss * mask.to(loss.dtype)).sum() / mask.sum().clamp_min(1)
        for loss, mask in zip(per_token_losses, loss_masks, strict=True)
    ]
    return torch.stack(sample_means).sum() / (num_samples or len(sample_means))


def per_token_mean(
    per_token_losses: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Masked token sum over all samples divided by the number of trainable tokens (DAPO-style).

    Longer responses weigh more. Trainers that accumulate over micro-batches pass the token count of
    the whole step as `num_tokens`.

    Args:
        per_token_losses (`list[torch.Tensor]`):
            Per-sample 1D per-token losses.
        loss_masks (`list[torch.Tensor]`):
            Per-sample loss masks, same shapes.
        num_tokens (`int`, *optional*):
            Denominator; defaults to the total of the masks (at least 1).

    Returns:
        `torch.Tensor`: Scalar loss.
    """
    if not per_token_losses:
        raise ValueError("per_token_mean got no samples")
    losses = torch.cat(per_token_losses)
    mask = torch.cat([m.to(losses.dtype) for m in loss_masks])
    if losses.shape != mask.shape:
        raise ValueError(f"per_token_losses and loss_masks hold {losses.numel()} vs {mask.numel()} tokens")
    denominator = num_tokens if num_tokens is not None else mask.sum().clamp_min(1)
    return (losses * mask).sum() / denominator


def aggregate_loss(
    per_token_losses: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    per_token: bool = False,
) -> torch.Tensor:
    """`per_token_mean` when `per_token` (`--calculate-per-token-loss`), else `sum_of_sample_mean`.

    Args:
        per_token_losses (`list[torch.Tensor]`):
            Per-sample 1D per-token losses.
        loss_masks (`list[torch.Tensor]`):
            Per-sample loss masks, same shapes.
        per_token (`bool`, *optional*, defaults to `False`):
            Average over tokens instead of over samples.

    Returns:
        `torch.Tensor`: Scalar loss.
    """
    if per_token:
        return per_token_mean(per_token_losses, loss_masks)
    return sum_of_sample_mean(per_token_losses, loss_masks)


def compute_sft_loss(
    log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    per_token: bool = False,
) -> torch.Tensor:
    """SFT loss: negative log-likelihood of the trainable tokens, aggregated like `aggregate_loss`.

    Args:
        log_probs (`list[torch.Tensor]`):
            Per-sample log-probs of the response tokens.
        loss_masks (`list[torch.Tensor]`):
            Per-sample loss masks, same shapes.
        per_token (`bool`, *optional*, defaults to `False`):
            Average over tokens instead of over samples.

    Returns:
        `torch.Tensor`: Scalar loss.
    """
    return aggregate_loss([-log_prob for log_prob in log_probs], loss_masks, per_token)
