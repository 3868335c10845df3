"""What the Megatron backend sends to the engines on a weight update: its weights under HF names.

Within a pipeline stage, each parameter is gathered over tensor (and expert) parallelism and converted
to its HF names by `megatron_to_hf.megatron_state_to_hf` (a collective every rank of the stage joins),
so every rank of the stage holds the stage's full tensors. Layer numbers are global: each chunk's
layers carry Megatron's global `layer_number`, which already counts the earlier stages and, with
virtual pipelining, the interleaved chunks. Only the first stage has the embedding and only the last
the final norm and the output layer (skipped when tied to the embedding), so the stages' HF names are
disjoint and together name every weight once.

Pipeline parallelism: the engines need every stage's weights, but the transports in
`slime.backends.weight_sync` send from fixed ranks (the first rank of each colocated engine's span, or
training rank 0 for the broadcast group and the disk folder), which hold one stage. So the stages forward
their buckets along their pipeline group: stage 0's rank produces its buckets and broadcasts each one to
the other ranks of its pipeline group, then stage 1's rank does the same, and so on. Every receiving rank
yields the buckets in that order, so the transport on top sees one stream of the whole model and
each tensor exactly once; the transports and `WeightUpdater` stay backend-neutral.

- Colocated (tensor paths, `WeightTransport.every_rank_sends`): any rank may serve an engine, so every
  pipeline group forwards and every rank yields the whole model (`hf_weight_buckets(..., to_every_rank=True)`).
- Disaggregated (broadcast and disk): only training rank 0 sends, so only the pipeline group of rank 0
  forwards (`to_every_rank=False`); the other ranks still produce their own stage's buckets, since
  that is a tensor/expert-parallel collective rank 0's stage-mates may be part of, but yield nothing.
  The price of one sending rank is that the stages' sends are serialized through it; per-stage
  broadcast groups to the engines would send in parallel but need a group per stage on every engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from slime.backends.megatron_utils.megatron_to_hf import megatron_state_to_hf
from slime.utils.weight_sync import Bucket, bucket_named_tensors


def hf_weights(
    model: list[nn.Module], family: str, vocab_size: int, dtype: torch.dtype | None = None, include_mtp: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor on the training device) of this rank's pipeline stage, a collective over the stage.

    Args:
        model: The model chunks (wrapped or not).
        family: Model family for the name mapping (e.g. "qwen3").
        vocab_size: The true vocabulary (padded rows are dropped).
        dtype: Cast to this dtype (None keeps the parameter dtype).
        include_mtp: Also the multi-token-prediction layers.

    Yields:
        Contiguous tensors that never alias a parameter (the mapping may return views of one).
    """
    for name, tensor in megatron_state_to_hf(model, family, vocab_size, include_mtp):
        yield name, tensor.detach().to(dtype or tensor.dtype).clone(memory_format=torch.contiguous_format)


def hf_weight_buckets(
    model: list[nn.Module],
    family: str,
    vocab_size: int,
    buffer_size: int,
    dtype: torch.dtype | None = None,
    to_every_rank: bool = True,
    include_mtp: bool = True,
) -> Iterator[Bucket]:
    """The whole model's HF weights in buckets of at most `buffer_size` bytes (`--update-weight-buffer-size`).

    A collective over all training ranks: every rank must iterate it to the end. Without pipeline
    parallelism every rank yields the (whole) model; with it, the stages forward their buckets along
    the pipeline group (see the module docstring).

    Args:
        model: The model chunks (wrapped or not).
        family: Model family for the name mapping (e.g. "qwen3").
        vocab_size: The true vocabulary (padded rows are dropped).
        buffer_size: Bucket byte limit.
        dtype: Cast to this dtype (None keeps the parameter dtype).
        to_every_rank: With pipeline parallelism, whether every rank gets the whole model (colocated
            engines) or only the pipeline group of training rank 0 does (broadcast and disk transports);
            the other ranks then yield nothing.
        include_mtp: Also the multi-token-prediction layers (SGLang's NEXTN draft reads them; the CPU engine,
            which has no draft model, takes none).

    Yields:
        Lists of (HF name, contiguous tensor on the training device), each name once over all buckets.
    """
    own = bucket_named_tensors(hf_weights(model, family, vocab_size, dtype, include_mtp), buffer_size)
    yield from _pipeline_buckets(own, model, to_every_rank)


def adapter_buckets(
    model: list[nn.Module], buffer_size: int, dtype: torch.dtype | None = None, to_every_rank: bool = True
) -> Iterator[Bucket]:
    """The LoRA adapter (lora.py) under PEFT saved names, full tensors, in buckets of at most `buffer_size` bytes:
    what `--lora-rank` pushes instead of the weights, and what a PEFT folder holds.

    A collective over all training ranks, forwarded over pipeline stages as `hf_weight_buckets` does (with
    `to_every_rank=False` only the pipeline group of rank 0 gets the whole adapter; the other ranks yield nothing).
    """
    from slime.backends.megatron_utils.lora import adapter_state_to_hf

    named = ((name, tensor.to(dtype or tensor.dtype).contiguous()) for name, tensor in adapter_state_to_hf(model))
    yield from _pipeline_buckets(bucket_named_tensors(named, buffer_size), model, to_every_rank)


def _pipeline_buckets(own: Iterator[Bucket], model: list[nn.Module], to_every_rank: bool) -> Iterator[Bucket]:
    """This stage's buckets `own`, and with pipeline parallelism every stage's (see the module docstring)."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        yield from own
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    if not to_every_rank and 0 not in dist.get_process_group_ranks(group):
        for _ in own:  # take part in this stage's gathers; rank 0 never needs these copies
            pass
        return
    yield from _forward_stage_buckets(own, group, _training_device(model))


def _training_device(model: list[nn.Module]) -> torch.device:
    return next(p.device for chunk in model for p in chunk.parameters())


def _forward_stage_buckets(own: Iterator[Bucket], group: dist.ProcessGroup, device: torch.device) -> Iterator[Bucket]:
    """Every stage's buckets, stage by stage, on every rank of the pipeline `group` (a collective over it).

    Per bucket the sending stage broadcasts the names, shapes and dtypes, then the tensors; None ends
    a stage. A name arriving twice means two stages claim the same weight: fail rather than send it twice.
    """
    my_stage = dist.get_rank(group)
    seen: set[str] = set()
    for stage in range(dist.get_world_size(group)):
        source = dist.get_global_rank(group, stage)
        sending = iter(own) if stage == my_stage else None
        while True:
            bucket = next(sending, None) if sending is not None else None
            header = [None if bucket is None else [(n, tuple(t.shape), t.dtype) for n, t in bucket]]
            dist.broadcast_object_list(header, src=source, group=group, device=device)
            if header[0] is None:
                break
            if bucket is None:
                bucket = [(name, torch.empty(shape, dtype=dtype, device=device)) for name, shape, dtype in header[0]]
            for _, tensor in bucket:
                dist.broadcast(tensor, src=source, group=group)
            duplicates = seen.intersection(name for name, _ in bucket)
            if duplicates:
                raise RuntimeError(
                    f"pipeline stage {stage} sends weights another stage already sent: {sorted(duplicates)}; "
                    "each HF weight must belong to exactly one stage"
                )
            seen.update(name for name, _ in bucket)
            yield bucket
