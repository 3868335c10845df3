"""Log-probs and entropy from (vocab-parallel) logits, and the losses of one micro-batch.

Vocab-parallel logits: with tensor parallelism each rank holds the logits of one slice of the
(padded) vocabulary. The softmax then needs three sums over the whole vocabulary, each an
all-reduce over the tensor-parallel group: the max (for stability, no gradient), the sum of
`exp(logit - max)`, and for the entropy the sum of `exp(logit - max) * (logit - max)`:

    log p(t) = (logit_t - max) - log S,    S = sum_v exp(logit_v - max)
    H        = log S - sum_v exp(logit_v - max) * (logit_v - max) / S

The summing all-reduces are Megatron's `reduce_from_tensor_model_parallel_region` (identity in
backward: every rank computes the same loss from the reduced sums). Megatron pads the vocabulary;
the padded entries are masked out so the softmax runs over the true vocabulary, as the HF model's
and the engine's do. With one tensor-parallel rank the shared `slime.algorithms.logprobs` functions
are used on the true-vocabulary slice, the same calls as the FSDP backend.

The loss assembly and its step normalizer are backend-neutral (`slime.algorithms.losses`), the same as the
FSDP backend's: identical log-probs give identical losses. The trainer scales the loss for
Megatron's gradient averaging.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime.algorithms.aggregation import StepNormalizer
from slime.algorithms.importance import icepop_function as icepop_function  # upstream's path for it
from slime.algorithms.logprobs import compute_entropy_from_logits, compute_log_probs
from slime.algorithms.losses import Metrics, policy_loss_from_log_probs, sft_loss_from_log_probs
from slime.utils.misc import load_function

# Logit given to padded vocabulary entries: exp() of it is exactly 0, and 0 * it is 0 (not nan).
_MASKED_LOGIT = -1e30


def _tp_group_and_rank() -> tuple[dist.ProcessGroup | None, int, int]:
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return None, 0, 1
    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank(), size


def log_probs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target and the entropy of each row, over the true vocabulary.

    Args:
        logits: `[M, padded_vocab / TP]` this rank's vocabulary slice, temperature already applied.
        targets: `[M]` token ids (global vocabulary ids).
        vocab_size: The true vocabulary (HF `vocab_size`); padded entries beyond it are ignored.
        with_entropy: Also return the entropy (else None).

    Returns:
        (`[M]` float32 log-probs, `[M]` float32 entropies or None), identical on every TP rank.
    """
    logits = logits.float()
    group, rank, size = _tp_group_and_rank()
    if size == 1:
        logits = logits[:, :vocab_size]
        entropy = compute_entropy_from_logits(logits) if with_entropy else None
        return compute_log_probs(logits, targets), entropy

    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    local_vocab = logits.shape[-1]
    start = rank * local_vocab
    padded = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
    logits = logits.masked_fill(padded, _MASKED_LOGIT)
    row_max = logits.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))

    local_target = targets.long() - start
    on_rank = (local_target >= 0) & (local_target < local_vocab)
    picked = shifted.gather(-1, local_target.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_shifted = reduce_from_tensor_model_parallel_region(picked * on_rank)
    log_probs = target_shifted - sum_exp.log()

    entropy = None
    if with_entropy:
        weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
        entropy = sum_exp.log() - weighted / sum_exp
    return log_probs, entropy


@dataclass
class ResponseOutputs:
    """What the model produced for a micro-batch's response tokens.

    Attributes:
        logits: `[M, padded_vocab / TP]` this rank's vocabulary slice, divided by the temperature.
        log_probs: `[M]` log-probs of the targets over the true vocabulary.
        entropy: `[M]` entropies (with gradient only when `--entropy-coef` is non-zero).
    """

    logits: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor


def policy_loss(
    args: Namespace, batch: dict, outputs: ResponseOutputs, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """The `--loss-type` policy loss (TIS), plus entropy bonus and KL-to-reference loss.

    Same definition as the FSDP backend's: identical inputs give identical values.

    Args:
        args: `loss_type`, `advantage_estimator`, `eps_clip`, `eps_clip_high`, `eps_clip_c`, `use_tis` (+
            `custom_tis_function_path`, `tis_clip`, `tis_clip_low`), `entropy_coef`, `use_kl_loss`,
            `kl_loss_coef`, `kl_loss_type`, `use_unbiased_kl`.
        batch: Per-sample lists of the micro-batch: `log_probs` (old), `advantages`, `loss_masks`,
            `ref_log_probs`, `rollout_log_probs`, ...; plus `response_lengths` and `total_lengths`.
        outputs: The current policy's log-probs and entropies of the response tokens.
        normalizer: The step's denominators.

    Returns:
        (loss to backpropagate, metrics: loss, pg_loss, pg_clipfrac, ppo_kl, entropy, kl_loss, tis_*).
    """
    return policy_loss_from_log_probs(args, batch, outputs.log_probs, outputs.entropy, normalizer)


def sft_loss(
    args: Namespace, batch: dict, outputs: ResponseOutputs, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """Negative log-likelihood of the trainable response tokens (`--loss-type sft_loss`)."""
    return sft_loss_from_log_probs(batch, outputs.log_probs, normalizer)


def custom_loss(
    args: Namespace, batch: dict, outputs: ResponseOutputs, normalizer: StepNormalizer
) -> tuple[torch.Tensor, Metrics]:
    """`--custom-loss-function-path`: `f(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)`.

    `logits` is this rank's `[M, padded_vocab / TP]` vocabulary slice (temperature applied; use
    `log_probs_and_entropy` for softmax quantities under tensor parallelism); `batch` also carries
    `current_log_probs` (`[M]`). `sum_of_sample_mean(per_token_values)` is the step's reducer bound
    to the batch's loss masks; reduce the loss and metrics with it so they sum over micro-batches and ranks.
    """
    function = load_function(args.custom_loss_function_path)

    def reducer(per_token_values: list[torch.Tensor]) -> torch.Tensor:
        return normalizer.reduce(per_token_values, batch["loss_masks"])

    loss, metrics = function(args, batch | {"current_log_probs": outputs.log_probs}, outputs.logits, reducer)
    return loss, {"loss": loss.detach(), **{name: torch.as_tensor(value).detach() for name, value in metrics.items()}}


# Keyed by `slime.algorithms.policy_losses.loss_kind(--loss-type)`: every registered policy loss runs `policy_loss`.
LOSS_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, Metrics]]] = {
    "policy_loss": policy_loss,
    "sft_loss": sft_loss,
    "custom_loss": custom_loss,
}
