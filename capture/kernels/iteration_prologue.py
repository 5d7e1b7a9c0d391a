"""The iteration's prologue: every token's position, slot and input id, and its embedding row,
read straight from the relay's rows.

Per span (decode spans read the relay; prompt chunks and padding read the staged inputs):

    seq_lens[r]      = relay.seq_lens[decode ? slot : 0]   (what `relay.resolve` returns)
    base[r]          = decode ? seq_lens[r] : span_base[r]  (the span's first position)

per token t of span r at offset j (the padding span R holds slot 0 and base 0):

    position         = base[r] + j; past the cache (a verify row near the end, always
                       rejected) it is clamped to max_seq_len - 1 and moved to padding slot 0
    ids[t]           = relay.tokens[slot] for a decode span's first token, else the staged id
    embedded[t]      = embed[ids[t]]                        (the residual stream's first value)

and per sampled row s, the position of the token it samples after (`row_positions`).

Two backends write the same static buffers. "torch" (the CPU default, and the reference) is
the glue the step ran before: `relay.resolve` and a dozen small torch ops, ~14 graph nodes.
"triton" (the CUDA default) is ONE launch that reads the relay's buffers itself, as
`graphrelay.kernels.gather_kernel` would (an out-of-range slot reads padding row 0). A relay in
debug mode keeps the torch path: its consume-once checks live in its own resolve.

When speculating the drafts are written into `ids` after the prologue and before the model
reads them, so the step asks for no embedding then (`embeds=False`) and the model gathers it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from graphrelay.capture.kernels.layer_kernels import _num_warps, _pick_backend

if TYPE_CHECKING:
    from graphrelay import Relay
    from graphrelay.capture.iteration.inputs import Geometry, InputsView


class PrologueBuffers(NamedTuple):
    """What the prologue writes, static at full shape; `narrow` gives one bucket's views."""

    seq_lens: torch.Tensor  # [R + 1] int64: each span's relay seq len (padding entry R never written)
    base: torch.Tensor  # [R + 1] int64: each span's first position
    positions: torch.Tensor  # [T] int64, clamped into the cache
    slots: torch.Tensor  # [T] int64, 0 = padding (or a position past the cache)
    row_positions: torch.Tensor  # [S] int64: position of the token each sampled row samples after
    embedded: Optional[torch.Tensor]  # [T, hidden] model dtype, or None (`embeds=False`)

    def narrow(self, g: "Geometry") -> "PrologueBuffers":
        spans = g.spans + 1
        return PrologueBuffers(self.seq_lens[:spans], self.base[:spans], self.positions[: g.tokens],
                               self.slots[: g.tokens], self.row_positions[: g.rows],
                               None if self.embedded is None else self.embedded[: g.tokens])


class IterationPrologue:
    """The prologue's static buffers for up to `top` (the largest bucket's geometry) and its
    backend; `prologue(v, g)` runs one bucket and returns its views of the buffers.

    embed: the model's embedding table `[vocab, hidden]`, gathered into `embedded` when
    `embeds`. backend: "triton", "torch" or None (Triton on CUDA unless the relay debugs).
    """

    def __init__(self, relay: "Relay", embed: torch.Tensor, max_seq_len: int, top: "Geometry", *, embeds: bool,
                 backend: Optional[str] = None):
        if backend is None and relay.debug:
            backend = "torch"
        self.backend = _pick_backend(backend, relay.buffers["tokens"])
        if self.backend == "triton" and relay.debug:
            raise ValueError("a relay in debug mode checks its reads in its own resolve: use the prologue's torch backend")
        self.relay, self.embed, self.max_seq_len = relay, embed, max_seq_len
        device = relay.device

        def longs(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        spans = top.spans + 1
        self.buffers = PrologueBuffers(
            longs(spans), longs(spans), longs(top.tokens), longs(top.tokens), longs(top.rows),
            torch.zeros((top.tokens, embed.shape[1]), dtype=embed.dtype, device=device) if embeds else None)
        # The torch path's relay.resolve output: the tokens land in ids, the seq lens in seq_lens.
        self._resolved = (relay.alloc_resolved(spans, dtypes={"tokens": torch.int64}) if self.backend == "torch"
                          else None)

    def __call__(self, v: "InputsView", g: "Geometry") -> PrologueBuffers:
        out = self.buffers.narrow(g)
        if self.backend == "torch":
            self._torch(v, g, out)
        else:
            self._triton(v, g, out)
        return out

    def _torch(self, v: "InputsView", g: "Geometry", out: PrologueBuffers) -> None:
        R, max_seq_len = g.spans, self.max_seq_len
        decode = v.span_decode.bool()  # [R + 1]
        # Only decode spans read the relay: a prompt chunk's slot holds nothing yet.
        resolved = self.relay.resolve(torch.where(decode[:R], v.span_slot[:R], 0), out=self._resolved.narrow(R),
                                      fields=("tokens", "seq_lens"))
        out.seq_lens[:R].copy_(resolved.seq_lens)
        base = torch.where(decode, out.seq_lens, v.span_base, out=out.base)
        positions = torch.add(base.index_select(0, v.token_span), v.token_offset, out=out.positions)
        # A position past the cache moves its token to the padding slot.
        torch.index_select(v.span_slot, 0, v.token_span, out=out.slots).mul_(positions < max_seq_len)
        positions.clamp_(max=max_seq_len - 1)
        # Decode spans' input tokens from the relay; other spans scatter into the scratch entry.
        scratch = v.ids.shape[0] - 1
        v.ids.index_copy_(0, torch.where(decode[:R], v.span_q_start[:R], scratch), resolved.tokens)
        torch.index_select(positions, 0, v.row_token, out=out.row_positions)
        if out.embedded is not None:
            torch.index_select(self.embed, 0, v.ids[: g.tokens], out=out.embedded)

    def _triton(self, v: "InputsView", g: "Geometry", out: PrologueBuffers) -> None:
        hidden = self.embed.shape[1]
        block = triton.next_power_of_2(hidden)
        embedded = out.embedded if out.embedded is not None else out.positions  # unused unless EMBED
        _prologue_kernel[(max(g.tokens, g.spans + 1, g.rows),)](
            v.token_span, v.token_offset, v.span_slot, v.span_base, v.span_decode, v.row_token, v.ids,
            self.relay.buffers["tokens"], self.relay.buffers["seq_lens"], self.embed,
            out.seq_lens, out.base, out.positions, out.slots, out.row_positions, embedded,
            g.tokens, g.spans, g.rows, self.relay.config.max_reqs, self.max_seq_len, self.embed.shape[0],
            HIDDEN=hidden, BLOCK=block, EMBED=out.embedded is not None, num_warps=_num_warps(block),
        )


@triton.jit
def _span_start(span, span_slot_ptr, span_base_ptr, span_decode_ptr, relay_seq_lens_ptr, max_reqs):
    """(slot, is decode, relay row, relay seq len, first position) of one span."""
    slot = tl.load(span_slot_ptr + span)
    decode = tl.load(span_decode_ptr + span) != 0
    row = tl.where(decode, slot, 0)
    row = tl.where((row >= 0) & (row <= max_reqs), row, 0)  # as the relay's gather clamps
    seq_len = tl.load(relay_seq_lens_ptr + row).to(tl.int64)
    return slot, decode, row, seq_len, tl.where(decode, seq_len, tl.load(span_base_ptr + span))


@triton.jit
def _token_place(t, token_span_ptr, token_offset_ptr, span_slot_ptr, span_base_ptr, span_decode_ptr,
                 relay_seq_lens_ptr, max_reqs, max_seq_len):
    """(slot, clamped position, decode span's first token?, relay row) of flat token t."""
    span = tl.load(token_span_ptr + t)
    offset = tl.load(token_offset_ptr + t)
    slot, decode, row, _, base = _span_start(span, span_slot_ptr, span_base_ptr, span_decode_ptr,
                                             relay_seq_lens_ptr, max_reqs)
    position = base + offset
    slot = tl.where(position < max_seq_len, slot, 0)
    return slot, tl.minimum(position, max_seq_len - 1), decode & (offset == 0), row


@triton.jit
def _prologue_kernel(
    token_span_ptr, token_offset_ptr,  # [T] int64
    span_slot_ptr, span_base_ptr, span_decode_ptr,  # [R + 1] int64
    row_token_ptr,  # [S] int64
    ids_ptr,  # [T_max + 1] int64: staged ids; decode spans' first ids are written here
    relay_tokens_ptr, relay_seq_lens_ptr,  # [max_reqs + 1] the relay's rows, any int dtype
    embed_ptr,  # [vocab, HIDDEN]
    seq_lens_out, base_out,  # [R + 1] int64
    positions_out, slots_out,  # [T] int64
    row_positions_out,  # [S] int64
    embedded_out,  # [T, HIDDEN] (unused unless EMBED)
    tokens, spans, rows, max_reqs, max_seq_len, vocab,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= HIDDEN: one program holds a whole row
    EMBED: tl.constexpr,
):
    # Program i does token i, span i and sampled row i (whichever exist); each recomputes the
    # span values it needs from the inputs, so no program waits for another's stores.
    i = tl.program_id(0)
    if i < tokens:
        slot, position, from_relay, row = _token_place(i, token_span_ptr, token_offset_ptr, span_slot_ptr,
                                                       span_base_ptr, span_decode_ptr, relay_seq_lens_ptr,
                                                       max_reqs, max_seq_len)
        tl.store(positions_out + i, position)
        tl.store(slots_out + i, slot)
        token = tl.load(ids_ptr + i)
        if from_relay:
            token = tl.load(relay_tokens_ptr + row).to(tl.int64)
            tl.store(ids_ptr + i, token)
        if EMBED:
            cols = tl.arange(0, BLOCK)
            # An id outside the vocabulary (never staged by the scheduler) reads zeros rather
            # than memory past the table; every valid id reads its row unchanged.
            width = tl.where((token >= 0) & (token < vocab), HIDDEN, 0)
            value = tl.load(embed_ptr + token * HIDDEN + cols, mask=cols < width, other=0.0)
            tl.store(embedded_out + i.to(tl.int64) * HIDDEN + cols, value, mask=cols < HIDDEN)
    if i < spans + 1:
        _, _, _, seq_len, base = _span_start(i, span_slot_ptr, span_base_ptr, span_decode_ptr,
                                             relay_seq_lens_ptr, max_reqs)
        tl.store(base_out + i, base)
        if i < spans:  # the padding span's seq len is never read
            tl.store(seq_lens_out + i, seq_len)
    if i < rows:
        _, position, _, _ = _token_place(tl.load(row_token_ptr + i), token_span_ptr, token_offset_ptr,
                                         span_slot_ptr, span_base_ptr, span_decode_ptr, relay_seq_lens_ptr,
                                         max_reqs, max_seq_len)
        tl.store(row_positions_out + i, position)
