"""The CPU engine's inverse-CDF draw against a full float64 cumulative sum."""

from __future__ import annotations

import torch

from slime.backends.cpu_engine.sampling import inverse_cdf


def full_cumsum_pick(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)


def test_inverse_cdf_picks_the_token_a_full_cumulative_sum_picks():
    generator = torch.Generator().manual_seed(0)
    for vocab in (7, 256, 1000, 49152):  # fewer than a block, one block, a ragged last block, many blocks
        probs = torch.rand(64, vocab, generator=generator) ** 8  # uneven mass, like a softmax
        probs[:8, : vocab // 2] = 0.0  # filtered-out spans (top-k / top-p zero them)
        probs[8:16, vocab // 3 :] = 0.0
        uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
        picks = inverse_cdf(probs, uniforms)
        assert torch.equal(picks, full_cumsum_pick(probs, uniforms)), vocab
        assert (probs.gather(-1, picks.unsqueeze(-1)) > 0).all()


def test_inverse_cdf_at_the_ends_of_the_draw_picks_tokens_with_mass():
    probs = torch.zeros(3, 600)
    probs[:, 5], probs[:, 300], probs[:, 520] = 0.25, 0.5, 0.25
    uniforms = torch.tensor([0.0, 0.6, 1.0 - 1e-16], dtype=torch.float64)
    assert inverse_cdf(probs, uniforms).tolist() == [5, 300, 520]
