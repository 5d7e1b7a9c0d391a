"""How much memory an engine will take, estimated before anything is allocated, so an
impossible size is refused with the figure and the fix instead of failing half-built."""

from __future__ import annotations

import os
from typing import Optional

import msgspec
import torch

from graphrelay.capture.model.kv_cache import resolve_kv_cache_dtype
from graphrelay.capture.model.model import ModelConfig


class MemoryPlan(msgspec.Struct, frozen=True):
    weights: int
    kv_cache: int
    iteration_buffers: int  # logits and activations of the largest token bucket (graph memory)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.iteration_buffers


def plan_memory(c: ModelConfig, max_reqs: int, max_tokens: int, sampled_rows: int,
                kv_cache_dtype: str = "auto") -> MemoryPlan:
    """Bytes for `max_reqs` slots and iterations of up to `max_tokens` tokens with up to
    `sampled_rows` sampled rows, the KV cache in `kv_cache_dtype` (`capture.model.kv_cache`).
    Activations are counted generously (every layer's widest tensor; the LM head's output and
    a float32 copy of it, as the controls make)."""
    item = c.torch_dtype.itemsize
    kv_item = resolve_kv_cache_dtype(kv_cache_dtype, c.torch_dtype).itemsize
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.hidden_size * c.num_heads * c.head_dim
    per_layer += 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    weights = (c.num_layers * per_layer + embeddings + c.hidden_size) * item
    kv_cache = 2 * c.num_layers * (max_reqs + 1) * c.max_seq_len * c.num_kv_heads * c.head_dim * kv_item
    widest = max(2 * c.intermediate_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
    buffers = max_tokens * 4 * widest * item + sampled_rows * c.vocab_size * (item + 4)
    return MemoryPlan(weights, kv_cache, buffers)


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory free on `device` now, or None when it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_fits(plan: MemoryPlan, device: torch.device, ranks: int = 1) -> None:
    """`ranks`: processes that each take `plan` from this same memory (tensor-parallel ranks
    on one CPU share the host's RAM; on GPUs each rank checks its own device)."""
    free = free_bytes(device)
    if free is not None and ranks * plan.total > free:
        gib = 2**30
        each = f"{ranks} ranks x " if ranks > 1 else ""
        raise ValueError(
            f"this engine needs about {ranks * plan.total / gib:.1f} GiB on {device} ({each}KV cache {plan.kv_cache / gib:.1f} GiB, "
            f"weights {plan.weights / gib:.1f} GiB, iteration buffers {plan.iteration_buffers / gib:.1f} GiB) "
            f"but {free / gib:.1f} GiB is free; lower --max-reqs or --max-seq-len (the KV cache; --kv-cache-dtype fp8 "
            f"stores it in half of bf16's bytes), or "
            f"--max-batch / --max-tokens{', or use a smaller model' if ranks > 1 else ''}"
        )
