"""Attention that reads the static slot cache in place.

The KV cache is `[max_reqs + 1, max_seq_len, kvh, d]` per layer (slot 0 is padding scratch).

- `decode_attention`: one query row per (request, position), fixed-shape in the number of
  rows, capturable into a CUDA graph. On CUDA it is a Triton flash-decoding kernel that reads
  only `cache[slots[i], 0 : positions[i] + 1]`; on CPU it is `decode_attention_reference`,
  the model's original gather-and-mask math.
- `prefill_attention`: a padded batch of prompt chunks, eager (host-known lengths), through
  `scaled_dot_product_attention`.

Decode kernel layout: grid `(n, kvh, num_splits)`. A program loads every query head of one
KV-head group (so K/V are read once per group) and walks key blocks `split, split + S,
split + 2S, ...` up to the row's length, with an online softmax in float32. Interleaving the
blocks (rather than giving each split one contiguous range) keeps the splits balanced however
short the row is compared to `max_seq_len`; blocks past the row's length are never visited.
With S > 1 each split writes a normalized partial and its log-sum-exp (base 2) to a float32
workspace and a second kernel merges them; with S == 1 the first kernel writes the output.
S is a pure function of static shapes, never of tensor values.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per inner iteration
MIN_BLOCKS_PER_SPLIT = 2  # a split must have at least this much work at full length to pay off
MAX_SPLITS = 16  # upper bound of the heuristic; a workspace with this many never limits it
TARGET_PROGRAMS_PER_SM = 4  # split until about this many programs per SM are in flight (H200-tuned)
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, out_ptr, part_ptr, lse_ptr,
    stride_qn, stride_qh, stride_ks, stride_kp, stride_kh, stride_vs, stride_vp, stride_vh,
    stride_on, num_slots, max_seq_len, qk_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # Values are the caller's contract; clamping only keeps a bad one from reading outside
    # the cache (its result is unspecified). A position past the end sees the whole row.
    slot = tl.load(slots_ptr + row).to(tl.int64)
    slot = tl.where((slot >= 0) & (slot < num_slots), slot, 0)
    length = tl.minimum(tl.maximum(tl.load(pos_ptr + row).to(tl.int32), 0), max_seq_len - 1) + 1

    g = tl.arange(0, GROUP_PAD)  # query heads of this group, padded for tl.dot (M >= 16)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    # Dots run on float32 operands: bf16/fp16 values are exact in tf32, so with PRECISION
    # "tf32" this equals a bf16 dot with float32 accumulation (and Triton's interpreter
    # mis-multiplies bf16 dots). Float32 models use "ieee" to keep reference accuracy.
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0).to(tl.float32)  # [GROUP_PAD, D]
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max, log2 units
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(split * BLOCK, length, num_splits * BLOCK):
        keys = start + tl.arange(0, BLOCK)
        valid = keys < length
        k = tl.load(k_base + keys[:, None] * stride_kp + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [GROUP_PAD, BLOCK]
        # Every visited block holds key `start` < length, so m_new is finite.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + keys[:, None] * stride_vp + d[None, :], mask=valid[:, None], other=0.0)
        # Probabilities rounded to the value dtype, as the reference casts them for its einsum.
        p = p.to(v.dtype).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m = m_new

    if SINGLE:
        # Split 0 always holds key 0, so l > 0 here.
        o = acc / l[:, None]
        tl.store(out_ptr + row * stride_on + heads[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # A split that starts past the row's length visited nothing: neutral partial (lse -inf,
        # zeros rather than 0/0) so the merge gives it zero weight.
        seen = l > 0
        o = acc / tl.where(seen, l, 1.0)[:, None]
        lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
        at = (row * NUM_HEADS + heads) * num_splits + split  # [GROUP_PAD] into [n, h, S]
        tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], o, mask=g_ok[:, None])
        tl.store(lse_ptr + at, lse, mask=g_ok)


@triton.jit
def _decode_combine_kernel(
    part_ptr, lse_ptr, out_ptr, stride_on, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_DIM)
    at = (row * NUM_HEADS + head) * num_splits + s  # [SPLITS_PAD]
    lse = tl.load(lse_ptr + at, mask=s_ok, other=float("-inf"))
    # Split 0 is never empty, so the max is finite and empty splits get weight exp2(-inf) = 0.
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)  # [D]
    tl.store(out_ptr + row * stride_on + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty))


class AttentionWorkspace:
    """Float32 split scratch for `decode_attention`, allocated once so a captured graph
    always reads and writes the same addresses.

    One workspace serves every layer and every bucket of up to `max_rows` rows (calls run in
    stream order). Memory: `max_rows * num_heads * max_splits * (head_dim + 1) * 4` bytes.
    `max_splits=MAX_SPLITS` never limits the heuristic; fewer caps the split count.
    """

    def __init__(self, max_rows: int, num_heads: int, head_dim: int, max_splits: int,
                 device: torch.device | str) -> None:
        for name, value in (("max_rows", max_rows), ("num_heads", num_heads),
                            ("head_dim", head_dim), ("max_splits", max_splits)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AttentionWorkspace {name} must be a positive int, got {value!r}")
        self.max_rows, self.num_heads, self.head_dim, self.max_splits = max_rows, num_heads, head_dim, max_splits
        cells = max_rows * num_heads * max_splits
        self.partial = torch.empty(cells * head_dim, dtype=torch.float32, device=device)
        self.lse = torch.empty(cells, dtype=torch.float32, device=device)

    def views(self, n: int, num_heads: int, head_dim: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Partials `[n, h, S, d]` and lse `[n, h, S]`, prefixes of the flat buffers."""
        if (num_heads, head_dim) != (self.num_heads, self.head_dim):
            raise ValueError(
                f"AttentionWorkspace was built for {self.num_heads} heads x {self.head_dim} dims, "
                f"got q with {num_heads} x {head_dim}"
            )
        if n > self.max_rows or num_splits > self.max_splits:
            raise ValueError(
                f"AttentionWorkspace holds {self.max_rows} rows x {self.max_splits} splits, "
                f"asked for {n} x {num_splits}"
            )
        cells = n * num_heads * num_splits
        return (self.partial[: cells * head_dim].view(n, num_heads, num_splits, head_dim),
                self.lse[:cells].view(n, num_heads, num_splits))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    # The interpreter has no SMs to fill: one split unless a test forces more.
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_num_splits(n: int, kv_heads: int, max_len: int, sm_count: int, per_sm: int = TARGET_PROGRAMS_PER_SM) -> int:
    """Splits per row: enough programs for `per_sm` per SM, no split with under
    MIN_BLOCKS_PER_SPLIT blocks at full length, at most MAX_SPLITS. Static shapes only."""
    want = -(-per_sm * sm_count // (n * kv_heads))
    cap = -(-max_len // BLOCK_N) // MIN_BLOCKS_PER_SPLIT
    return max(1, min(want, cap, MAX_SPLITS))


def _check_cache_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      index_tensors: dict[str, torch.Tensor], q_dims: int,
                      cache_dtypes: tuple[torch.dtype, ...] = ()) -> None:
    """Metadata checks shared by decode and prefill (no values read). The cache holds q's dtype
    or, both K and V, one of `cache_dtypes`."""
    if q.dim() != q_dims:
        raise ValueError(f"q must have {q_dims} dims, got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [slots, max_seq_len, kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    heads, head_dim = q.shape[-2:]
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"q heads x dim {heads} x {head_dim} do not fit cache {tuple(k_cache.shape)}")
    allowed = (q.dtype, *cache_dtypes)
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise ValueError(f"k_cache and v_cache must both be {names} for q of {q.dtype}, "
                         f"got {k_cache.dtype} and {v_cache.dtype}")
    for name, t in index_tensors.items():
        if t.dim() != 1 or t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must be [{q.shape[0]}], got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), *index_tensors.items()):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> None:
    n, h, d = q.shape
    if out is not None and (out.shape != (n, h * d) or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must be a {q.dtype} [{n}, {h * d}] tensor on {q.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")


def _check_max_len(max_len: int, cache_len: int, name: str) -> None:
    if not isinstance(max_len, int) or isinstance(max_len, bool) or not 1 <= max_len <= cache_len:
        raise ValueError(f"{name} must be an int in 1..{cache_len} (the cache length), got {max_len!r}")


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, *, scale: float, out: torch.Tensor | None = None, max_len: int | None = None,
) -> torch.Tensor:
    """Pure-torch decode attention; fixed-shape (n rows x `max_len` keys), no host reads.

    q `[n, h, d]`; row i attends `cache[slots[i], 0 : positions[i] + 1]`. `max_len` (default
    the cache length) is a static bound the caller guarantees: every position < max_len.
    Returns `[n, h * d]` in q's dtype (written into `out` when given).
    """
    _check_cache_args(q, k_cache, v_cache, {"slots": slots, "positions": positions}, 3)
    _check_out(out, q)
    length = k_cache.shape[1] if max_len is None else max_len
    _check_max_len(length, k_cache.shape[1], "max_len")
    slots = slots.long()
    keys = k_cache[:, :length].index_select(0, slots)  # [n, L, kvh, d]
    values = v_cache[:, :length].index_select(0, slots)  # [n, L, kvh, d]
    result = attend_gathered(q, keys, values, positions, scale)
    return result if out is None else out.copy_(result)


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The references' math once each row has its own keys: q `[n, h, d]`, keys and values
    `[n, L, kvh, d]`; row i attends `keys[i, 0 : positions[i] + 1]`. Returns `[n, h * d]`."""
    n, h, d = q.shape
    length, kv_heads = keys.shape[1:3]
    # Additive mask from a position comparison, not boolean indexing: [n, L].
    visible = torch.arange(length, device=q.device)[None, :] <= positions.long()[:, None]
    mask = torch.where(visible, 0.0, float("-inf"))
    grouped = q.reshape(n, kv_heads, h // kv_heads, d)  # [n, kvh, g, d]
    # The model's numerics: scores in the model dtype, softmax in float32.
    scores = torch.einsum("nkgd,nskd->nkgs", grouped, keys).float()  # [n, kvh, g, L]
    scores = scores * scale + mask[:, None, None, :]
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.einsum("nkgs,nskd->nkgd", probs, values).reshape(n, h * d)


def _decode_attention_triton(q, k_cache, v_cache, slots, positions, scale, out, workspace, num_splits):
    n, h, d = q.shape
    kv_heads = k_cache.shape[2]
    group = h // kv_heads
    if d < 16 or d & (d - 1):
        raise ValueError(f"the Triton decode kernel needs head_dim a power of two >= 16, got {d}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dim, got strides {t.stride()}")
    for name, t in (("slots", slots), ("positions", positions)):
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if out is None:
        out = torch.empty(n, h * d, dtype=q.dtype, device=q.device)
    elif out.stride(1) != 1:
        raise ValueError(f"out must have a unit-stride last dim, got strides {out.stride()}")
    if num_splits > 1:
        if workspace is None:
            workspace = AttentionWorkspace(n, h, d, num_splits, q.device)
        elif workspace.partial.device != q.device:
            raise ValueError(f"workspace is on {workspace.partial.device}, q on {q.device}")
        partial, lse = workspace.views(n, h, d, num_splits)
    else:
        partial = lse = out  # unused by the single-split kernel
    _decode_split_kernel[(n, kv_heads, num_splits)](
        q, k_cache, v_cache, slots, positions, out, partial, lse,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), k_cache.shape[0], k_cache.shape[1], scale * _LOG2E,
        NUM_HEADS=h, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, BLOCK=BLOCK_N, SINGLE=num_splits == 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _decode_combine_kernel[(n, h)](
            partial, lse, out, out.stride(0), num_splits,
            NUM_HEADS=h, HEAD_DIM=d, SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=1,
        )
    return out


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor, *, scale: float, out: torch.Tensor | None = None,
    workspace: AttentionWorkspace | None = None, max_len: int | None = None,
    backend: str | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of `n` independent query rows over the slot cache; capturable.

    q `[n, h, d]` (the cache's dtype); slots, positions `[n]` int32/int64 on q's device. Row i
    attends `cache[slots[i], 0 : positions[i] + 1]` (this step's K/V already written). Rows
    may share a slot; padding rows use slot 0. Returns `[n, h * d]` in q's dtype (or `out`).

    backend: "triton" | "torch" (default: Triton on CUDA, the reference elsewhere).
    max_len: static bound with every position < max_len (default the cache length); the
    reference gathers that many keys, the kernel sizes its split count by it.
    num_splits: override the heuristic (tests); with a workspace it must fit it.
    """
    backend = backend or ("triton" if q.is_cuda else "torch")
    if backend == "torch":
        return decode_attention_reference(q, k_cache, v_cache, slots, positions,
                                          scale=scale, out=out, max_len=max_len)
    if backend != "triton":
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    _check_cache_args(q, k_cache, v_cache, {"slots": slots, "positions": positions}, 3)
    _check_out(out, q)
    length = k_cache.shape[1] if max_len is None else max_len
    _check_max_len(length, k_cache.shape[1], "max_len")
    if num_splits is None:
        num_splits = pick_num_splits(q.shape[0], k_cache.shape[2], length, _sm_count(q.device))
        if workspace is not None:
            num_splits = min(num_splits, workspace.max_splits)
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    return _decode_attention_triton(q, k_cache, v_cache, slots, positions, scale, out, workspace, num_splits)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    starts: torch.Tensor, lengths: torch.Tensor, *, scale: float, key_len: int | None = None,
) -> torch.Tensor:
    """Causal attention for a padded batch of prompt chunks; eager (not for capture).

    q `[B, T, h, d]`; slots, starts, lengths `[B]`. Query t of request b sits at position
    `starts[b] + t` of slot `slots[b]` and attends positions `0 ..` that (this chunk's K/V
    already written); rows t >= lengths[b] are padding (output finite, meaningless).
    key_len: `max(starts + lengths)` as a Python int (default the cache length).
    Returns `[B, T, h * d]` in q's dtype.
    """
    _check_cache_args(q, k_cache, v_cache, {"slots": slots, "starts": starts, "lengths": lengths}, 4)
    key_len = k_cache.shape[1] if key_len is None else key_len
    _check_max_len(key_len, k_cache.shape[1], "key_len")
    batch, chunk, h, d = q.shape
    kv_heads = k_cache.shape[2]
    group = h // kv_heads
    slots = slots.long()

    def heads_first(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[:, :key_len].index_select(0, slots)  # [B, Lk, kvh, d]
        # Query head j reads KV head j // group (the model's grouping). Expanded rather than
        # SDPA's enable_gqa (torch >= 2.5 only, and no masked fused kernel supports it).
        rows = rows.permute(0, 2, 1, 3)[:, :, None].expand(batch, kv_heads, group, key_len, d)
        return rows.reshape(batch, h, key_len, d)

    # Padding rows reuse the last real row's position, so they never look at unwritten keys
    # and always see key 0 (a fully masked row would be NaN).
    last = (starts.long() + lengths.long() - 1).clamp_min(0)  # [B]
    query_pos = torch.minimum(starts.long()[:, None] + torch.arange(chunk, device=q.device), last[:, None])
    visible = torch.arange(key_len, device=q.device)[None, None, :] <= query_pos[:, :, None]  # [B, T, Lk]
    result = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), heads_first(k_cache), heads_first(v_cache),
        attn_mask=visible[:, None], scale=scale,
    )  # [B, h, T, d]
    return result.transpose(1, 2).reshape(batch, chunk, h * d)
