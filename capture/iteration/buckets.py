"""Batch-size buckets: one captured graph per bucket, a batch replays the smallest that fits."""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

# Dense where small batches are common and padding is proportionally expensive, coarse above.
_DENSE = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_COARSE_STEP = 16


def default_buckets(max_batch: int) -> list[int]:
    """1..32 densely, then every 16 up to max_batch; max_batch itself is always a bucket."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {b for b in _DENSE if b <= max_batch}
    sizes.update(range(_DENSE[-1] + _COARSE_STEP, max_batch + 1, _COARSE_STEP))
    sizes.add(max_batch)
    return sorted(sizes)


def check_buckets(buckets: Sequence[int], max_batch: int) -> list[int]:
    """Sorted, de-duplicated buckets within 1..max_batch, or a ValueError saying which is bad."""
    if not buckets:
        raise ValueError("bucket list is empty; pass at least one batch size (e.g. default_buckets(max_batch))")
    for b in buckets:
        if not isinstance(b, int) or not 1 <= b <= max_batch:
            raise ValueError(f"bucket {b!r} must be an int in 1..max_batch ({max_batch})")
    return sorted(set(buckets))


def bucket_for(buckets: Sequence[int], bs: int) -> Optional[int]:
    """Smallest bucket >= bs (buckets sorted), or None when bs exceeds the largest."""
    i = bisect.bisect_left(buckets, bs)
    return buckets[i] if i < len(buckets) else None
