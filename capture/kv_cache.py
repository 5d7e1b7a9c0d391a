"""Static KV cache indexed by `[slot, position]`, allocated once at full shape.

Rows are `max_reqs + 1`: row 0 is the padding slot's scratch (DESIGN.md §2.2). A padded batch
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

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store one K/V per row at `[slots[i], positions[i]]`; all index tensors int64 `[n]`.

        k, v: `[n, num_kv_heads, head_dim]`.
        """
        # Flat row index into a [(max_reqs + 1) * max_seq_len, kvh, d] view: one index_copy_
        # per tensor, fixed shape in n.
        # NOTE: duplicate indices are only legal for padding rows (slot 0, fill position);
        # which duplicate wins is unspecified on CUDA, harmless because row 0 is scratch.
        flat = slots * self.max_seq_len + positions  # [n]
        for cache, new in ((self.keys[layer], k), (self.values[layer], v)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, flat, new.to(cache.dtype))

    def rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather whole cache rows for each slot: K, V each `[n, max_seq_len, kvh, d]`."""
        return self.keys[layer].index_select(0, slots), self.values[layer].index_select(0, slots)

    def slot_rows(self, layer: int, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's rows broadcast to `n` queries without copying: `[n, max_seq_len, kvh, d]`."""
        k, v = self.keys[layer][slot], self.values[layer][slot]
        return k.expand(n, *k.shape), v.expand(n, *v.shape)
