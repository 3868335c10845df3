"""Sampling parameters (SGLang's names and defaults) and the per-step token sampler.

Log-prob convention (what RL needs): the reported log-prob of a token is
`log_softmax(raw_logits / temperature)` at that token, in fp32, over the *full* vocabulary,
from the same logits the token was sampled from. Temperature 0 means greedy and reports the
plain `log_softmax(raw_logits)`. Top-k / top-p / min-p filtering and the `min_new_tokens`
stop-token mask only change which token is drawn, never the reported log-prob, so the
trainer can recompute it with one forward pass and `logits / temperature`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """Per-request sampling parameters, named and defaulted as in SGLang.

    Args:
        max_new_tokens: Most tokens to generate; None means up to the context length.
        min_new_tokens: Stop tokens and stop strings are ignored (stop tokens masked) before this many tokens.
        temperature: 0 means greedy.
        top_p: Nucleus sampling mass, in (0, 1].
        top_k: Keep the k most likely tokens; -1 keeps all.
        min_p: Drop tokens whose probability is below `min_p` times the top probability.
        stop: Stop strings; the output text is cut before the first match unless `no_stop_trim`.
        stop_token_ids: Extra token ids that end generation like EOS does.
        ignore_eos: Keep going past EOS and `stop_token_ids`.
        skip_special_tokens: Leave special tokens out of the returned text.
        no_stop_trim: Keep the matched stop string / stop token in the returned text.
        sampling_seed: Seed of this request's own random generator, for reproducible sampling.
    """

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filtering(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k / top-p / min-p leave out, row by row.

    Args:
        logits: (rows, vocab) temperature-scaled logits.
        top_k: Per row; values <= 0 keep everything.
        top_p: Per row, in (0, 1].
        min_p: Per row, in [0, 1].

    Returns:
        A new (rows, vocab) tensor; the most likely token of every row always survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab).expand_as(sorted_logits)
    k = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(-1)
    drop = rank >= k
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 must keep the whole tail even when rounding pushes the running mass past 1.
    drop |= mass_before >= torch.tensor([p if p < 1.0 else float("inf") for p in top_p]).unsqueeze(-1)
    drop |= probs < torch.tensor(min_p).unsqueeze(-1) * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned_token_ids: list[list[int]],
) -> tuple[list[int], list[float]]:
    """Pick one token per row and report its log-prob (see the module docstring for the convention).

    Args:
        logits: (rows, vocab) raw next-token logits.
        params: One `SamplingParams` per row.
        generators: One per row; None rows draw from torch's default generator.
        banned_token_ids: Per row, tokens that must not be drawn this step (stop tokens before min_new_tokens).

    Returns:
        (token ids, their log-probs), one per row.
    """
    logits = logits.float()
    temperatures = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params]).unsqueeze(-1)
    scaled = logits / temperatures
    log_probs = scaled.log_softmax(dim=-1)

    draw_logits = scaled
    if any(banned_token_ids):
        draw_logits = draw_logits.clone()
        for row, banned in enumerate(banned_token_ids):
            if banned:
                draw_logits[row, banned] = float("-inf")
    filtered_rows = [row for row, p in enumerate(params) if p.needs_filtering]
    if filtered_rows:
        draw_logits = draw_logits.clone()
        draw_logits[filtered_rows] = filter_logits(
            draw_logits[filtered_rows],
            [params[row].top_k for row in filtered_rows],
            [params[row].top_p for row in filtered_rows],
            [params[row].min_p for row in filtered_rows],
        )

    tokens = draw_logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        probs = draw_logits[sampled_rows].softmax(dim=-1)
        shared = [i for i, row in enumerate(sampled_rows) if generators[row] is None]
        if shared:
            tokens[[sampled_rows[i] for i in shared]] = torch.multinomial(probs[shared], 1).squeeze(-1)
        for i, row in enumerate(sampled_rows):
            if generators[row] is not None:
                tokens[row] = torch.multinomial(probs[i], 1, generator=generators[row])[0]

    token_log_probs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), token_log_probs.tolist()
