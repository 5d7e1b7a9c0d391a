"""Static KV cache indexed by `[slot, position]`, allocated once at full shape.

Rows are `max_reqs + 1`: row 0 is the padding slot's scratch (docs/design.md §2.2). A padded batch
row (slot 0) writes there and reads from there, so it can never touch a request's row.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K and V, each `[max_reqs + 1, max_seq_len, num_kv_heads, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        max_reqs: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (max_reqs + 1, max_seq_len, num_kv_heads, head_dim)
        self.max_reqs = max_reqs
        self.max_seq_len = max_seq_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
