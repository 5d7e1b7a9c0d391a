"""Token-count buckets: one captured graph per bucket, an iteration replays the smallest that
fits its tokens (decode rows, prompt chunks and verify spans together)."""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

# Dense where small iterations are common and padding is proportionally expensive, coarser
# above: (up to, step) pairs. Padding costs at most one step's worth of tokens, under 1/4 of
# the bucket above 32 tokens.
_DENSE = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_STEPS = ((256, 16), (512, 64), (1024, 128), (4096, 256))


def default_buckets(max_tokens: int) -> list[int]:
    """1..32 densely, every 16 up to 256, then coarser; max_tokens itself is always a bucket."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = {b for b in _DENSE if b <= max_tokens}
    low = _DENSE[-1]
    for high, step in _STEPS:
        sizes.update(range(low + step, min(high, max_tokens) + 1, step))
        low = high
    sizes.update(range(low + 1024, max_tokens + 1, 1024))
    sizes.add(max_tokens)
    return sorted(sizes)


def check_buckets(buckets: Sequence[int], largest: int) -> list[int]:
    """Sorted, de-duplicated buckets within 1..largest, or a ValueError saying which is bad."""
    if not buckets:
        raise ValueError("bucket list is empty; pass at least one size (e.g. default_buckets(max_tokens))")
    for b in buckets:
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= largest:
            raise ValueError(f"bucket {b!r} must be an int in 1..{largest} (max_tokens)")
    return sorted(set(buckets))


def bucket_for(buckets: Sequence[int], bs: int) -> Optional[int]:
    """Smallest bucket >= bs (buckets sorted), or None when bs exceeds the largest."""
    i = bisect.bisect_left(buckets, bs)
    return buckets[i] if i < len(buckets) else None
