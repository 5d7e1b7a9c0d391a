"""Applying the controls to logits rows: a torch reference and two fused Triton launches.

Per row r (slot s = row_slots[r], automaton state g = row_states[r], step p = row_steps[r]),
over every token t, in this order:
  1. repetition (HF): a token seen in the prompt or generated has its logit divided by
     rep[s] when positive, else multiplied by it;
  2. frequency / presence (OpenAI): minus freq[s] * n + pres[s] * (n > 0), n = times generated
     (for a verify row, also the drafts before it in its span: `row_drafts` [n, k], -1 = none);
  3. masks (-inf): a token the automaton state g does not allow; a stop token of s while
     p < eos_until[s] (min_tokens);
  4. logit_bias: plus bias[s, j] at token bias_ids[s, j] (unique per slot, -1 = unused);
     a masked token stays -inf.
`counts[s, t]` packs both histories: bit PROMPT_BIT = t is in the prompt; the low bits = times
generated. The result goes to `out` (the raw logits stay for logprobs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .row_tensors import check_row_tensors

PROMPT_BIT = 1 << 30
GENERATED_MASK = PROMPT_BIT - 1
BLOCK = 1024  # tokens per program of the dense pass
DENSE_WARPS = 4  # its warps (H200, 64 rows: 8 warps or wider blocks were no faster)


class ControlTables(NamedTuple):
    """Per-slot device tables the apply reads, row 0 = padding (neutral); see `SamplingControls`."""

    counts: torch.Tensor  # [R + 1, V] int32: PROMPT_BIT | times generated
    penalties: torch.Tensor  # [R + 1, 3] float32: frequency, presence, repetition
    eos_until: torch.Tensor  # [R + 1] int64: stop tokens masked at steps below it
    stop_ids: torch.Tensor  # [R + 1, S] int32, -1 = unused
    bias_ids: torch.Tensor  # [R + 1, B] int32, -1 = unused
    bias_values: torch.Tensor  # [R + 1, B] float32
    allowed: torch.Tensor  # [states, ceil(V / 32)] int32 grammar bitmask (row 0: all)


def apply_torch(tables, logits, row_slots, row_steps, row_states, out, row_drafts=None):
    """The reference: plain torch ops, any device. 16-bit logits count as their float32 values."""
    logits = logits.float()
    slots = row_slots.long()
    vocab = logits.shape[1]
    token = torch.arange(vocab, device=logits.device)
    counts = tables.counts[slots]  # [n, V]
    if row_drafts is not None:
        counts = counts + (token[None, :, None] == row_drafts[:, None, :]).sum(-1, dtype=torch.int32)
    generated = (counts & GENERATED_MASK).float()
    penalties = tables.penalties[slots]  # [n, 3]: freq, pres, rep
    freq, pres, rep = (penalties[:, i : i + 1] for i in range(3))
    x = torch.where(counts != 0, torch.where(logits > 0, logits / rep, logits * rep), logits)
    x = x - generated * freq - (generated > 0).float() * pres
    words = tables.allowed[row_states.long()][:, token >> 5]  # [n, V]
    allowed = ((words >> (token & 31)) & 1) != 0
    stop_ids = tables.stop_ids[slots]  # [n, S]
    stopping = (row_steps.long() < tables.eos_until[slots])[:, None]
    is_stop = (token[None, :, None] == stop_ids[:, None, :]).any(-1) & stopping
    x = torch.where(allowed & ~is_stop, x, float("-inf"))
    ids = tables.bias_ids[slots].long()
    bias = torch.where(ids >= 0, tables.bias_values[slots], 0.0)
    out.copy_(x.scatter_add(1, ids.clamp(min=0), bias))
    return out


@triton.jit
def _dense_kernel(logits_ptr, logits_stride, out_ptr, out_stride, slots_ptr, steps_ptr, states_ptr,
                  counts_ptr, penalties_ptr, eos_until_ptr, stop_ptr, allowed_ptr, drafts_ptr, vocab, words,
                  NUM_STOP: tl.constexpr, NUM_DRAFTS: tl.constexpr, DRAFTS_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = tokens < vocab
    slot = tl.load(slots_ptr + row).to(tl.int64)
    step = tl.load(steps_ptr + row).to(tl.int64)
    state = tl.load(states_ptr + row).to(tl.int64)
    freq = tl.load(penalties_ptr + slot * 3)
    pres = tl.load(penalties_ptr + slot * 3 + 1)
    rep = tl.load(penalties_ptr + slot * 3 + 2)
    stopping = step < tl.load(eos_until_ptr + slot)
    x = tl.load(logits_ptr + row * logits_stride + tokens, mask=valid, other=0.0).to(tl.float32)
    # A row whose controls leave its logits as they are (no penalty, the automaton's
    # all-allowed state 0, min_tokens reached; its bias is the second launch's): each step
    # below would return x exactly, so it is a copy, without reading its counts and masks
    # (a batch whose requests only ask for logprobs runs this variant too).
    if (freq == 0.0) & (pres == 0.0) & (rep == 1.0) & (state == 0) & (stopping == 0):
        tl.store(out_ptr + row * out_stride + tokens, x, mask=valid)
    else:
        counts = tl.load(counts_ptr + slot * vocab + tokens, mask=valid, other=0)
        if NUM_DRAFTS > 0:
            j = tl.arange(0, DRAFTS_BLOCK)
            drafts = tl.load(drafts_ptr + row * NUM_DRAFTS + j, mask=j < NUM_DRAFTS, other=-1)  # [D]
            counts += tl.sum((tokens[:, None] == drafts[None, :]).to(tl.int32), axis=1)
        generated = (counts & 0x3FFFFFFF).to(tl.float32)
        # IEEE division and no fused multiply-adds (enable_fp_fusion=False at launch): the same
        # roundings as the torch reference's separate ops.
        x = tl.where(counts != 0, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
        x = x - generated * freq - (generated > 0).to(tl.float32) * pres
        word = tl.load(allowed_ptr + state * words + (tokens >> 5), mask=valid, other=0)
        keep = ((word >> (tokens & 31)) & 1) != 0
        stops = tl.load(stop_ptr + slot * NUM_STOP + tl.arange(0, NUM_STOP))  # [S]
        is_stop = tl.sum((tokens[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0
        keep = keep & ~(is_stop & stopping)
        tl.store(out_ptr + row * out_stride + tokens, tl.where(keep, x, float("-inf")), mask=valid)


@triton.jit
def _bias_kernel(out_ptr, out_stride, slots_ptr, bias_ids_ptr, bias_values_ptr, NUM_BIAS: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    j = tl.arange(0, NUM_BIAS)
    ids = tl.load(bias_ids_ptr + slot * NUM_BIAS + j).to(tl.int64)
    values = tl.load(bias_values_ptr + slot * NUM_BIAS + j)
    used = ids >= 0
    where = out_ptr + row * out_stride + ids
    # The ids of one slot are distinct (a dict's keys), so no two lanes touch one logit.
    tl.store(where, tl.load(where, mask=used, other=0.0) + values, mask=used)


def apply_triton(tables, logits, row_slots, row_steps, row_states, out, row_drafts=None):
    """Two launches, no torch ops and no temporaries: fixed shape in the row count.
    row_drafts, when given, must be contiguous."""
    n, vocab = logits.shape
    check_row_tensors("apply_triton", n, row_slots=row_slots, row_steps=row_steps, row_states=row_states)
    if row_drafts is not None and (row_drafts.shape[0] != n or not row_drafts.is_contiguous()):
        raise ValueError(f"apply_triton: row_drafts must be contiguous [{n}, k], got {tuple(row_drafts.shape)} "
                         f"strides {row_drafts.stride()}")
    num_drafts = 0 if row_drafts is None else row_drafts.shape[1]
    _dense_kernel[(n, triton.cdiv(vocab, BLOCK))](
        logits, logits.stride(0), out, out.stride(0), row_slots, row_steps, row_states,
        tables.counts, tables.penalties, tables.eos_until, tables.stop_ids, tables.allowed,
        row_slots if row_drafts is None else row_drafts, vocab, tables.allowed.shape[1],
        NUM_STOP=tables.stop_ids.shape[1], NUM_DRAFTS=num_drafts,
        DRAFTS_BLOCK=triton.next_power_of_2(max(num_drafts, 1)), BLOCK=BLOCK, num_warps=DENSE_WARPS,
        enable_fp_fusion=False,
    )
    _bias_kernel[(n,)](out, out.stride(0), row_slots, tables.bias_ids, tables.bias_values,
                       NUM_BIAS=tables.bias_ids.shape[1])
    return out


def span_row_drafts(drafts: torch.Tensor) -> torch.Tensor:
    """Each verify row's preceding drafts: [b * (k + 1), k], row j of a span holds drafts
    0..j-1 then -1 (none). Fixed shape, capturable; penalties count them as generated."""
    b, k = drafts.shape
    before = torch.arange(k, device=drafts.device)[None, :] < torch.arange(k + 1, device=drafts.device)[:, None]
    return torch.where(before[None], drafts.long()[:, None, :], -1).reshape(b * (k + 1), k)
