"""Fixed-shape, sync-free token sampling: greedy, or seeded temperature + top-k (Gumbel-max).

Randomness comes from a counter-based integer hash of (seed, step, vocab index) in plain torch
int64 ops, not from torch's global RNG: a row's token depends only on its own logits, seed and
step, so it is the same under CUDA graph replay and eager, on CPU and GPU, and wherever the
row sits in the batch. Every op is row-wise and fixed-shape in `bs`; nothing branches on
values (greedy rows are selected with `torch.where`), so `sample` can be captured.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import msgspec
import torch

_MASK32 = 0xFFFFFFFF
_INT64_RANGE = (-(2**63), 2**63 - 1)


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request sampling. temperature 0 is greedy; top_k 0 keeps the whole vocabulary."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be a finite float >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = no cut), got {self.top_k!r}")
        if not isinstance(self.seed, int) or not _INT64_RANGE[0] <= self.seed <= _INT64_RANGE[1]:
            raise ValueError(f"SamplingParams.seed must be an int that fits in int64, got {self.seed!r}")


class SamplingTensors(NamedTuple):
    """A batch's sampling params as CPU tensors, each [batch_size]; padded rows are greedy."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int32
    seeds: torch.Tensor  # int64


def pack_sampling_params(params: Sequence[SamplingParams], batch_size: int) -> SamplingTensors:
    """Host-side: lay out `params` in rows 0..len-1 of [batch_size] tensors, greedy padding."""
    if len(params) > batch_size:
        raise ValueError(f"{len(params)} sampling params do not fit in a batch of {batch_size}")
    pad = batch_size - len(params)
    return SamplingTensors(
        temperature=torch.tensor([p.temperature for p in params] + [0.0] * pad, dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params] + [0] * pad, dtype=torch.int32),
        seeds=torch.tensor([p.seed for p in params] + [0] * pad, dtype=torch.int64),
    )


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), with no int64 overflow.

    NOTE: signed int64 overflow is undefined in C++, so the product is split into 16-bit
    halves of the constant: each partial product stays below 2**48.
    """
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (lowbias32: xorshift-multiply) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Fold each row's (seed, step), both full int64, into one 32-bit key: [bs] int64."""
    key = torch.zeros_like(seeds)
    for word in (seeds, seeds >> 32, steps, steps >> 32):
        # `>>` is arithmetic on negative values; the mask keeps 32 clean bits either way.
        key = hash32(key ^ (word & _MASK32))
    return key


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [bs, vocab] float32, a pure function of (seed, step, vocab index)."""
    vocab_keys = hash32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64))  # [V]
    bits = hash32(_row_keys(seeds, steps)[:, None] ^ vocab_keys[None, :])  # [bs, V]
    # 23 random bits + 0.5 is exact in float32, so u lies strictly inside (0, 1).
    uniform = ((bits >> 9).float() + 0.5) * 2.0**-23
    return -torch.log(-torch.log(uniform))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    out: torch.Tensor | None = None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Pick one token per row: tokens [bs] int64.

    logits [bs, V] float32; temperature [bs] float32 (0 = greedy); top_k [bs] int32/int64
    (0 or >= V = no cut); seeds, steps [bs] int32/int64. A request should pass a step that
    differs at every decode step, e.g. its seq len. Capturable: only metadata is checked.

    max_top_k (a static int) ranks only that many logits per row instead of the whole
    vocabulary, which is much cheaper; a top_k between max_top_k and V is then cut at
    max_top_k, while 0 (or >= V) still means no cut.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"sample logits must be float32 [bs, vocab], got {logits.dtype} {tuple(logits.shape)}")
    bs, vocab_size = logits.shape
    for name, t, dtypes in (
        ("temperature", temperature, (torch.float32,)),
        ("top_k", top_k, (torch.int32, torch.int64)),
        ("seeds", seeds, (torch.int32, torch.int64)),
        ("steps", steps, (torch.int32, torch.int64)),
    ):
        if t.shape != (bs,) or t.dtype not in dtypes or t.device != logits.device:
            raise ValueError(
                f"sample {name} must be [{bs}] of {[str(d) for d in dtypes]} on {logits.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if out is not None and (out.shape != (bs,) or out.dtype != torch.int64 or out.device != logits.device):
        raise ValueError(f"sample out must be an int64 [{bs}] tensor on {logits.device}")
    if max_top_k is not None and (not isinstance(max_top_k, int) or max_top_k < 1):
        raise ValueError(f"sample max_top_k must be None or a positive int, got {max_top_k!r}")
    width = vocab_size if max_top_k is None else min(max_top_k, vocab_size)

    greedy = logits.argmax(dim=-1)  # [bs]

    # Top-k by threshold: keep logits >= the row's k-th largest (ties at the threshold stay).
    top_k = top_k.long()
    no_cut = (top_k <= 0) | (top_k >= vocab_size)  # [bs]
    ranked = logits.topk(width, dim=-1).values  # [bs, width], descending
    kth = ranked.gather(1, (top_k.clamp(1, width) - 1)[:, None])  # [bs, 1]
    threshold = torch.where(no_cut[:, None], float("-inf"), kth)  # [bs, 1]
    # Greedy rows get temperature 1 here only to stay finite; their sample is discarded.
    safe_temperature = torch.where(temperature > 0, temperature, 1.0)[:, None]  # [bs, 1]
    scaled = torch.where(logits >= threshold, logits / safe_temperature, float("-inf"))
    sampled = (scaled + gumbel_noise(seeds.long(), steps.long(), vocab_size)).argmax(dim=-1)  # [bs]

    tokens = torch.where(temperature > 0, sampled, greedy)
    return tokens if out is None else out.copy_(tokens)
