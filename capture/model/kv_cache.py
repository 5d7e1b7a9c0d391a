"""Static KV cache indexed by `[slot, position]`, allocated once at full shape.

Rows are `max_reqs + 1`: row 0 is the padding slot's scratch (docs/design.md §2.2). A padded batch
row (slot 0) writes there and reads from there, so it can never touch a request's row.

The cache holds the model's dtype ("auto") or, opt-in, float8 e4m3 ("fp8"): half the bytes
of bf16, so the same memory holds twice the tokens and attention over long contexts reads half
as much. The kernels that append K/V round each value to nearest even on the e4m3 grid,
saturating at +-448 (`layer_kernels.to_cache_dtype` is the same in torch), with no scale
(e4m3's range covers the K/V of Llama-family models); the kernels that read it widen it
exactly to the model dtype. It changes outputs (3 mantissa bits where bf16 has 7), so it is a
tuned setting, never the default. On an H100 it is a capacity setting more than a speed one:
decode rows over long contexts ran ~8% faster, long prompt chunks ~30% slower (their tiles are
widened in registers on the way to the tensor cores), and the offline workload 3.8% slower
(results/kv_cache_fp8_h100.txt).
"""

from __future__ import annotations

import torch

from graphrelay.capture.kernels.layer_kernels import CACHE_FLOAT8

# `--kv-cache-dtype` names; None: the model's own dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": CACHE_FLOAT8}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the cache stores for a `KV_CACHE_DTYPES` name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"KV cache dtype {name!r} is not supported; use one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


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
