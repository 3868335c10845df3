"""The pure parts of a weight update, shared by both training backends: bucketing HF-named tensors, the probe
sequence and the tolerance for comparing trainer and engine log-probs.

The transports and every call to an engine live in `slime.backends.weight_sync`; the payload formats both
sides share in `slime.utils.weight_transport`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from slime.utils.device import cuda_available

Bucket = list[tuple[str, torch.Tensor]]


def bucket_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], buffer_size: int) -> Iterator[Bucket]:
    """Group (HF name, tensor) pairs, in order, into buckets of at most `buffer_size` bytes.

    Args:
        named_tensors: Full tensors under their HF names, ready to send (contiguous, final dtype).
        buffer_size: Bucket byte limit (`--update-weight-buffer-size`); a larger single tensor goes alone.

    Yields:
        Lists of (name, tensor).
    """
    bucket: Bucket = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > buffer_size:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def probe_tokens(vocab_size: int, length: int = 24) -> list[int]:
    """A fixed token sequence spread over the vocabulary, for comparing trainer and engine log-probs."""
    return [(7 * i + 3) % vocab_size for i in range(length)]


def weight_check_tolerance() -> float:
    """Largest |trainer - engine| probe log-prob gap accepted after a weight update: fp32 CPU engines agree
    to ~1e-5; bf16 GPU engines differ by up to ~0.1 even with identical weights."""
    return 0.1 if cuda_available() else 1e-3
