"""Split samples across data-parallel ranks so each rank gets a similar number of tokens."""

from __future__ import annotations

import heapq


def balanced_partitions(lengths: list[int], num_partitions: int) -> list[list[int]]:
    """Partition sample indices into `num_partitions` groups of equal count with balanced token sums.

    Greedy longest-processing-time: visit samples longest first and give each to the lightest
    partition that still has room. Every partition gets `len(lengths) // num_partitions` samples
    (the first `len % num_partitions` get one more).

    Args:
        lengths: Token count of each sample.
        num_partitions: Number of data-parallel ranks.

    Returns:
        For each partition, the sorted indices of its samples.
    """
    n = len(lengths)
    capacity = [n // num_partitions + (1 if p < n % num_partitions else 0) for p in range(num_partitions)]
    heap = [(0, p) for p in range(num_partitions)]  # (token sum, partition)
    partitions: list[list[int]] = [[] for _ in range(num_partitions)]
    for index in sorted(range(n), key=lambda i: -lengths[i]):
        full = []
        while True:
            load, p = heapq.heappop(heap)
            if len(partitions[p]) < capacity[p]:
                break
            full.append((load, p))
        partitions[p].append(index)
        heapq.heappush(heap, (load + lengths[index], p))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(part) for part in partitions]
