"""The CPU engine's tensor kernels against plain computations: its inverse-CDF draw, its finite-values check."""

from __future__ import annotations

import torch

from slime.backends.cpu_engine.sampling import inverse_cdf
from slime.backends.cpu_engine.weights import all_finite


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


def test_all_finite_agrees_with_isfinite_even_when_the_sum_overflows():
    cases = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        finite = torch.linspace(-2.0, 2.0, 1000).to(dtype)
        cases.append(finite)
        huge = torch.full((1000,), torch.finfo(dtype).max, dtype=torch.float64).to(dtype)  # its sum overflows
        cases.append(huge)
        if dtype != torch.float8_e4m3fn:  # e4m3fn has no infinity
            for bad in (float("nan"), float("inf"), float("-inf")):
                broken = finite.clone()
                broken[517] = bad
                cases.append(broken)
        else:
            broken = finite.clone()
            broken[517] = float("nan")
            cases.append(broken)
    pair = torch.tensor([float("inf"), float("-inf")])  # sums to NaN, not to an infinity
    cases.append(pair)
    for tensor in cases:
        widened = tensor.double()  # every value of these dtypes, exactly
        assert all_finite(tensor) == bool(torch.isfinite(widened).all()), (tensor.dtype, tensor[515:519])
