"""Log-probabilities and entropies of tokens from logits, in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
