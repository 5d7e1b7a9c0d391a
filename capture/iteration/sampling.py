"""Fixed-shape, sync-free token sampling: greedy, or seeded temperature + top-k + top-p
(Gumbel-max).

Randomness comes from a counter-based integer hash of (seed, step, vocab index), not from
torch's global RNG: a row's token depends only on its own logits, seed and step, so it is the
same under CUDA graph replay and eager, wherever the row sits in the batch, and on CPU and GPU
up to an ulp of log/exp (see `sample`).

Two backends compute the same function. "torch" (the reference, and the CPU default) is plain
row-wise torch ops; "triton" (the CUDA default) is three fused launches
(`capture.sampling_kernel`) that hash the noise in registers. Both are fixed-shape in `bs` and
never branch on values on the host, so `sample` can be captured.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Sequence

import msgspec
import torch

from graphrelay.capture.kernels.sampling_kernel import MAX_RANKED, ChunkResults, sample_triton
from graphrelay.capture.kernels.sampling_kernel import sample_chunks as sample_triton_chunks

_MASK32 = 0xFFFFFFFF
_INT64_RANGE = (-(2**63), 2**63 - 1)
# float32's smallest normal. A subnormal temperature is flushed to zero by some GPU math (so
# logit gaps would divide into NaN) and one below 2**-149 rounds to 0, silently greedy.
MIN_TEMPERATURE = 2.0**-126
BACKENDS = ("torch", "triton")
# A model's 16-bit LM head output is sampled as it is: widening to float32 is exact, so the
# sampler reads it and widens in registers (the float32 copy would be one more [bs, vocab] pass).
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request sampling. temperature 0 is greedy; top_k 0 keeps the whole vocabulary;
    top_p 1 disables the nucleus cut (see `sample` for the exact semantics)."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if not (math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or a finite float >= "
                f"{MIN_TEMPERATURE:.8g} (float32's smallest normal), got {t}"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = no cut), got {self.top_k!r}")
        if not isinstance(self.seed, int) or not _INT64_RANGE[0] <= self.seed <= _INT64_RANGE[1]:
            raise ValueError(f"SamplingParams.seed must be an int that fits in int64, got {self.seed!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be a float in (0, 1] (1 = no nucleus cut), got {self.top_p!r}")


class SamplingTensors(NamedTuple):
    """A batch's sampling params as CPU tensors, each [batch_size]; padded rows are greedy."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int32
    top_p: torch.Tensor  # float32
    seeds: torch.Tensor  # int64


def pack_sampling_params(params: Sequence[SamplingParams], batch_size: int) -> SamplingTensors:
    """Host-side: lay out `params` in rows 0..len-1 of [batch_size] tensors, greedy padding."""
    if len(params) > batch_size:
        raise ValueError(f"{len(params)} sampling params do not fit in a batch of {batch_size}")
    pad = batch_size - len(params)
    return SamplingTensors(
        temperature=torch.tensor([p.temperature for p in params] + [0.0] * pad, dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params] + [0] * pad, dtype=torch.int32),
        top_p=torch.tensor([p.top_p for p in params] + [1.0] * pad, dtype=torch.float32),
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


def keep_threshold(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold, row max), each [bs, 1] float32: a sampled row keeps the logits >= threshold
    (-inf = no cut). `width` is how many logits per row are ranked (see `sample`)."""
    vocab_size = logits.shape[1]
    ranked = logits.topk(width, dim=-1).values  # [bs, W], descending
    top = ranked[:, :1]  # [bs, 1]
    top_k = top_k.long()[:, None]  # [bs, 1]
    no_top_k = (top_k <= 0) | (top_k >= vocab_size)
    count = torch.where(no_top_k, width, top_k.clamp(1, width))  # ranked entries in the top-k set
    kth = torch.where(no_top_k, float("-inf"), ranked.gather(1, count - 1))  # [bs, 1]
    if top_p is None:
        return kth, top
    safe_temperature = torch.where(temperature > 0, temperature, 1.0)[:, None]  # [bs, 1]
    # Unnormalised probabilities relative to the row max (<= 1, so no overflow), totalled over
    # the top-k set's ranked entries, or over the whole vocabulary without top-k.
    in_set = torch.arange(width, device=logits.device)[None, :] < count  # [bs, W]
    weights = torch.where(in_set, torch.exp((ranked - top) / safe_temperature), 0.0)  # [bs, W]
    vocab_mass = torch.exp((logits - top) / safe_temperature).sum(-1, keepdim=True)  # [bs, 1]
    mass = torch.where(no_top_k, vocab_mass, weights.sum(-1, keepdim=True))  # [bs, 1]
    # Ranked entries whose inclusive cumulative probability is still below top_p; the nucleus
    # ends at the next one (cumsum is non-decreasing, so counting finds the first crossing).
    below = ((weights.cumsum(-1) / mass < top_p[:, None]) & in_set).sum(-1, keepdim=True)  # [bs, 1]
    nucleus = ranked.gather(1, torch.minimum(below, count - 1))  # [bs, 1]
    return torch.where(top_p[:, None] < 1, nucleus, kth), top


def _sample_torch(logits, temperature, top_k, top_p, seeds, steps, width) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)  # [bs]
    threshold, top = keep_threshold(logits, temperature, top_k, top_p, width)
    # Greedy rows get temperature 1 here only to stay finite; their sample is discarded.
    safe_temperature = torch.where(temperature > 0, temperature, 1.0)[:, None]  # [bs, 1]
    # Shifting by the row max cannot change the argmax, and keeps tiny temperatures from
    # dividing large logits into +inf ties.
    scaled = torch.where(logits >= threshold, (logits - top) / safe_temperature, float("-inf"))
    sampled = (scaled + gumbel_noise(seeds.long(), steps.long(), logits.shape[1])).argmax(dim=-1)  # [bs]
    return torch.where(temperature > 0, sampled, greedy)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    out: torch.Tensor | None = None,
    max_top_k: int | None = None,
    *,
    top_p: torch.Tensor | None = None,
    backend: str | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row: tokens [bs] int64.

    logits [bs, V] float32, bfloat16 or float16 (sampled as their exact float32 values; each
    row with a finite max); temperature [bs] float32 (<= 0 = greedy); top_k [bs] int32/int64
    (0 or >= V = no cut); top_p [bs] float32 (>= 1 = no cut; None = no cut in any row); seeds,
    steps [bs] int32/int64. A request should pass a step that differs at every decode step,
    e.g. its seq len. Capturable: only metadata is checked.

    A greedy row takes the argmax (the first index among equal maxima). A sampled row, with
    s_1 >= s_2 >= ... its logits sorted (ties repeated) and W = min(max_top_k, V) (V when
    max_top_k is None), keeps every logit >= s_m (ties with s_m included), where:
      - top-k: n = min(top_k, W) when 0 < top_k < V (a top_k above max_top_k is cut at W);
        otherwise n = V;
      - top-p: with p_j = exp((s_j - s_1) / T) / Z and Z totalled over j <= n, the nucleus ends
        at the first j whose cumulative p_1 + ... + p_j reaches top_p, but searched within the
        W ranked logits: a nucleus wider than W is cut at s_W;
      - m = min(n, W, that j) when top_p < 1; else m = n (so m = V keeps everything).
    The token is then the argmax over kept logits of (logit - s_1) / T plus Gumbel noise, a
    pure function of (seed, step, vocab index): an exact draw from softmax(logits / T) over the
    kept set. The top token is always kept. max_top_k (a static int) thus ranks only W logits
    per row instead of the whole vocabulary, which is much cheaper.

    backend: "torch" (the reference) or "triton" (three fused launches, no torch ops; it ranks
    at most MAX_RANKED logits, so it needs max_top_k <= MAX_RANKED or a vocabulary that small,
    and on CPU tensors TRITON_INTERPRET=1). The default is "triton" on CUDA when max_top_k
    allows it, else "torch". The backends give the same tokens except where float rounding can
    differ: log/exp may round an ulp apart (between CPU and GPU too) and the nucleus mass is
    summed in another order, which flips a token only when two perturbed scores, or a
    cumulative probability and top_p, are within about 1e-6 of each other.

    counters: the Triton backend's `[bs]` int32 scratch, zero between calls (it leaves it
    zero): pass one allocated up front under capture (`sample_triton`); the torch backend
    ignores it.
    """
    width, backend = _checked(logits, temperature, top_k, top_p, seeds, steps, max_top_k, backend)
    if out is not None and (out.shape != (logits.shape[0],) or out.dtype != torch.int64 or out.device != logits.device):
        raise ValueError(f"sample out must be an int64 [{logits.shape[0]}] tensor on {logits.device}")
    if backend == "triton":
        out = out if out is not None else torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        return sample_triton(logits, temperature, top_k, top_p, seeds, steps, out, width, counters=counters)
    tokens = _sample_torch(logits.float(), temperature, top_k, top_p, seeds, steps, width)
    return tokens if out is None else out.copy_(tokens)


def sample_chunks(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    max_top_k: int | None = None,
    *,
    top_p: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> ChunkResults:
    """`sample` on its Triton backend without the last pass: the per-chunk results from which
    `capture.kernels.sampling_kernel.pick_rows` picks the same tokens `sample` returns (the
    iteration's fused epilogue runs that pass in its own launch). The arguments and checks are
    `sample`'s; the Triton backend must apply (`triton_applies`)."""
    width, _ = _checked(logits, temperature, top_k, top_p, seeds, steps, max_top_k, "triton")
    return sample_triton_chunks(logits, temperature, top_k, top_p, seeds, steps, width, counters=counters)


def triton_applies(logits: torch.Tensor, max_top_k: int | None) -> bool:
    """Whether `sample`'s Triton backend can sample these logits with this max_top_k: it ranks
    at most MAX_RANKED logits a row, and on CPU tensors it runs only under TRITON_INTERPRET=1."""
    width = logits.shape[1] if max_top_k is None else min(max_top_k, logits.shape[1])
    return width <= MAX_RANKED and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _checked(logits, temperature, top_k, top_p, seeds, steps, max_top_k, backend) -> tuple[int, str]:
    """`sample`'s argument checks (metadata only); returns the ranked width and the backend."""
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"sample logits must be [bs, vocab] of {[str(d) for d in LOGIT_DTYPES]}, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    bs, vocab_size = logits.shape
    rows = {"temperature": (temperature, (torch.float32,)), "top_k": (top_k, (torch.int32, torch.int64))}
    if top_p is not None:
        rows["top_p"] = (top_p, (torch.float32,))
    rows.update(seeds=(seeds, (torch.int32, torch.int64)), steps=(steps, (torch.int32, torch.int64)))
    for name, (t, dtypes) in rows.items():
        if t.shape != (bs,) or t.dtype not in dtypes or t.device != logits.device:
            raise ValueError(
                f"sample {name} must be [{bs}] of {[str(d) for d in dtypes]} on {logits.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if max_top_k is not None and (not isinstance(max_top_k, int) or max_top_k < 1):
        raise ValueError(f"sample max_top_k must be None or a positive int, got {max_top_k!r}")
    width = vocab_size if max_top_k is None else min(max_top_k, vocab_size)
    backend = backend or ("triton" if logits.is_cuda and width <= MAX_RANKED else "torch")
    if backend not in BACKENDS:
        raise ValueError(f"sample backend {backend!r} is not one of {BACKENDS}")
    if backend == "triton":
        if width > MAX_RANKED:
            raise ValueError(
                f"sample backend 'triton' ranks at most {MAX_RANKED} logits per row: pass max_top_k <= "
                f"{MAX_RANKED} (got {max_top_k}, vocab {vocab_size}) or backend='torch'"
            )
        if not logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("sample backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                             "importing triton")
        if logits.stride(1) != 1:
            raise ValueError("sample backend 'triton' needs logits rows contiguous (stride(1) == 1)")
    return width, backend
