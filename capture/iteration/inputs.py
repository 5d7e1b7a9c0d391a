"""The static input surface of one unified iteration: max-shape device buffers the graphs read.

An iteration is a flat batch of up to `max_tokens` tokens from up to `max_spans` requests,
each a query span (`capture.iteration.spans`): a decode row, a prefill chunk, or a verify span.
The host lays the batch out in a pinned staging buffer (token ids of prompt chunks, each
token's span and offset in it, per-span metadata and sampling params, per-sampled-row token
index, and the attention's query blocks) and copies it to the device with ONE non-blocking
copy. What the host cannot know (a decode span's position and input token, the drafts) the
captured step resolves on the device from the relay and the token history.

Geometry of a token bucket `T` (all static): `R = min(T, max_spans)` spans plus one padding
span at index `R` (slot 0, position 0) that padding tokens point to; `S = R * rows_per_span`
sampled rows, request-major (span r owns rows r * rows_per_span ..); `NB` query blocks for
the attention kernel. The graphs read `[:T]`, `[:R + 1]`, `[:S]` and `[:NB]` views, whose
addresses never change. The token buffer has one scratch entry past `max_tokens` that
padding spans scatter into.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from graphrelay.capture.iteration.spans import Span
from graphrelay.capture.kernels.q_blocks import Q_BLOCK, max_q_blocks, q_block_arrays
from graphrelay.runtime import Event

_ALIGN = 16  # bytes: every field view starts 16-byte aligned


class Geometry(NamedTuple):
    """Static sizes of one token bucket."""

    tokens: int  # T
    spans: int  # R (the padding span is index R)
    rows: int  # S = R * rows_per_span
    q_blocks: int  # NB
    q_block: int  # tokens per query block of the attention


def bucket_spans(tokens: int, max_spans: int) -> int:
    """R of a bucket of `tokens` tokens; its sampled rows are R * rows_per_span (also what the
    memory plan sizes before any buffer exists)."""
    return min(tokens, max_spans)


class InputsView(NamedTuple):
    """One bucket's views of the device inputs."""

    ids: torch.Tensor  # [T_max + 1] int64: prompt token ids; decode ids and drafts land here on device
    token_span: torch.Tensor  # [T] int64: the span each token belongs to (R: padding)
    token_offset: torch.Tensor  # [T] int64: the token's index inside its span
    span_slot: torch.Tensor  # [R + 1] int64, 0 = padding
    span_base: torch.Tensor  # [R + 1] int64: a prefill chunk's first position (decode: resolved)
    span_decode: torch.Tensor  # [R + 1] int64 0/1: position and input token come from the relay
    span_verify: torch.Tensor  # [R + 1] int64 0/1: a decode span carrying drafts (speculation)
    span_samples: torch.Tensor  # [R + 1] int64 0/1: its sampled token is reported
    span_q_start: torch.Tensor  # [R + 1] int64: flat index of its first token (padding: scratch)
    temperature: torch.Tensor  # [R + 1] float32, 0 = greedy
    top_k: torch.Tensor  # [R + 1] int32, 0 = no cut
    seeds: torch.Tensor  # [R + 1] int64
    top_p: torch.Tensor  # [R + 1] float32, 1 = no cut
    row_token: torch.Tensor  # [S] int64: flat index of the token whose logits this row samples
    row_live: torch.Tensor  # [S] int64 0/1: the row may be emitted (padding rows never)
    q_block_start: torch.Tensor  # [NB] int32
    q_block_len: torch.Tensor  # [NB] int32, 0 = padding block


# name -> (dtype, level, padding value); level sizes the field: tokens, spans, rows, blocks.
_FIELDS = {
    "ids": (torch.int64, "ids", 0),
    "token_span": (torch.int64, "tokens", None),  # padding tokens point at the padding span R
    "token_offset": (torch.int64, "tokens", 0),
    "span_slot": (torch.int64, "spans", 0),
    "span_base": (torch.int64, "spans", 0),
    "span_decode": (torch.int64, "spans", 0),
    "span_verify": (torch.int64, "spans", 0),
    "span_samples": (torch.int64, "spans", 0),
    "span_q_start": (torch.int64, "spans", None),  # padding spans scatter into the scratch entry
    "temperature": (torch.float32, "spans", 0.0),
    "top_k": (torch.int32, "spans", 0),
    "seeds": (torch.int64, "spans", 0),
    "top_p": (torch.float32, "spans", 1.0),
    "row_token": (torch.int64, "rows", 0),
    "row_live": (torch.int64, "rows", 0),
    "q_block_start": (torch.int32, "blocks", 0),
    "q_block_len": (torch.int32, "blocks", 0),
}


class IterationInputs:
    """Device input buffers at full shape plus `depth` pinned staging copies of the same layout.

    max_tokens: the most tokens one iteration carries (the largest bucket). max_spans: the most
    requests it carries. rows_per_span: sampled rows per span (k + 1 when speculating, else 1).

    NOTE: a staging copy may be rewritten only after the device copy that last read it ran;
    with `depth` copies and a loop that keeps one iteration in flight, depth 2 never waits. If
    it would, `load` blocks on that copy's event and counts it in `staging_waits` (and the host
    time it blocked in `staging_wait_s`: launches queued further ahead, as a benchmark's busy
    loop queues them, wait there for the GPU).

    A load of decode spans equal to the last load's, for the same bucket, lays out nothing and
    copies nothing (counted in `loads_skipped`): the device buffers hold that layout already.
    The step rewrites only the ids of decode and draft tokens there, and rewrites them each
    iteration before reading them. Steady decode then costs the GPU no copy (~5 us an
    iteration on an H100 for the default 4,096-token layout) and the host no layout.
    """

    def __init__(self, max_tokens: int, max_spans: int, rows_per_span: int, device: torch.device | str,
                 depth: int = 2):
        self.max_tokens, self.max_spans, self.rows_per_span = max_tokens, max_spans, rows_per_span
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        top = self.geometry(max_tokens)
        # Query blocks grow with the bucket within each q_block regime: the largest
        # one-token-per-block bucket or the largest bucket needs the most.
        blocks = max(top.q_blocks, self.geometry(min(max_tokens, max_spans * rows_per_span)).q_blocks)
        self._sizes = {"ids": max_tokens + 1, "tokens": max_tokens, "spans": top.spans + 1, "rows": top.rows,
                       "blocks": blocks}
        offsets, end = {}, 0
        for name, (dtype, level, _) in _FIELDS.items():
            offsets[name] = end
            end += -(-self._sizes[level] * dtype.itemsize // _ALIGN) * _ALIGN
        self._offsets, self._nbytes = offsets, end
        self._device_bytes = torch.zeros(end, dtype=torch.uint8, device=self.device)
        self.buffers = self._views(self._device_bytes)
        # On the CPU the device buffers are host memory already: load writes them directly.
        depth = depth if self.on_gpu else 1
        self._staging = torch.zeros((depth, end), dtype=torch.uint8, pin_memory=self.on_gpu)
        staged = [self._views(self._staging[k]) for k in range(depth)] if self.on_gpu else [self.buffers]
        self._staged = [{name: t.numpy() for name, t in view._asdict().items()} for view in staged]
        self._copied = [Event(device=self.device) for _ in range(depth)] if self.on_gpu else []
        self._next = 0
        self.staging_waits = 0
        self.staging_wait_s = 0.0
        self.loads_skipped = 0
        self._last_load: tuple | None = None  # (bucket, decode_tokens, spans) of an all-decode load

    def geometry(self, tokens: int) -> Geometry:
        spans = bucket_spans(tokens, self.max_spans)
        # Buckets a decode-only iteration can fill give every token its own query block (one
        # program reads a slot's keys for one token's GQA group, as a decode kernel would);
        # larger ones, which carry prompt chunks, share each key tile among Q_BLOCK tokens.
        q_block = 1 if tokens <= self.max_spans * self.rows_per_span else Q_BLOCK
        return Geometry(tokens, spans, spans * self.rows_per_span, max_q_blocks(tokens, spans, q_block), q_block)

    def _views(self, raw: torch.Tensor) -> InputsView:
        return InputsView(**{
            name: raw[self._offsets[name]: self._offsets[name] + self._sizes[level] * dtype.itemsize].view(dtype)
            for name, (dtype, level, _) in _FIELDS.items()
        })

    def narrow(self, tokens: int) -> InputsView:
        g = self.geometry(tokens)
        sizes = {"ids": self.max_tokens + 1, "tokens": g.tokens, "spans": g.spans + 1, "rows": g.rows,
                 "blocks": g.q_blocks}
        return InputsView(*(t[: sizes[_FIELDS[name][1]]] for name, t in zip(InputsView._fields, self.buffers)))

    def load(self, spans: list[Span], tokens: int, decode_tokens: int, stream=None) -> None:
        """Lay `spans` out for bucket `tokens` and copy them to the device on `stream` (a torch
        CUDA stream; ignored on the CPU) without blocking the host. `decode_tokens`: tokens per
        decode span (k + 1 when it verifies drafts, else 1). The caller has checked the spans."""
        load = (tokens, decode_tokens, list(spans))
        if load == self._last_load:
            self.loads_skipped += 1
            return
        self._last_load = None  # until this layout is on its way to the device
        g = self.geometry(tokens)
        k = self._next
        if self.on_gpu and not self._copied[k].query():
            self.staging_waits += 1
            waited_from = time.perf_counter()
            self._copied[k].synchronize()
            self.staging_wait_s += time.perf_counter() - waited_from
        self._fill(self._staged[k], spans, g, decode_tokens)
        if self.on_gpu:
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                self._device_bytes.copy_(self._staging[k], non_blocking=True)
            self._copied[k].record(stream)
            self._next = (k + 1) % len(self._staged)
        # Only decode spans can repeat: a prompt chunk's tokens are a list the caller owns.
        if all(s.is_decode for s in spans):
            self._last_load = load

    def _fill(self, host: dict[str, np.ndarray], spans: list[Span], g: Geometry, decode_tokens: int) -> None:
        n_spans, per = len(spans), self.rows_per_span
        lengths = [len(s.tokens) if s.tokens else decode_tokens for s in spans]
        starts = np.zeros(n_spans + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        used = int(starts[-1])
        # Padding first, then the spans over it.
        for name, (_, level, pad) in _FIELDS.items():
            if level != "ids" and pad is not None:
                host[name][: self._level_size(level, g)] = pad
        host["token_span"][: g.tokens] = g.spans
        host["span_q_start"][: g.spans + 1] = self.max_tokens
        host["token_span"][:used] = np.repeat(np.arange(n_spans, dtype=np.int64), lengths)
        host["token_offset"][:used] = np.arange(used, dtype=np.int64) - np.repeat(starts[:-1], lengths)
        # Per-span columns as lists, written with one slice assignment each (a Python loop of
        # numpy item writes costs ~10x more at 256 spans).
        q_start = starts[:-1]
        decode = np.array([not s.tokens for s in spans], dtype=bool)
        host["span_slot"][:n_spans] = [s.slot for s in spans]
        host["span_q_start"][:n_spans] = q_start
        host["temperature"][:n_spans] = [s.params.temperature for s in spans]
        host["top_k"][:n_spans] = [s.params.top_k for s in spans]
        host["seeds"][:n_spans] = [s.params.seed for s in spans]
        host["top_p"][:n_spans] = [s.params.top_p for s in spans]
        host["span_base"][:n_spans] = [s.start for s in spans]
        host["span_decode"][:n_spans] = decode
        host["span_verify"][:n_spans] = decode & (decode_tokens > 1)
        samples = np.array([s.samples or not s.tokens for s in spans], dtype=bool)
        host["span_samples"][:n_spans] = samples
        # Sampled rows, request-major: a prompt chunk samples after its last token (row 0), a
        # decode or verify span after each of its tokens.
        rows = np.arange(n_spans) * per
        host["row_token"][rows] = q_start + np.asarray(lengths) - 1
        host["row_live"][rows] = samples
        if decode_tokens > 1:  # verify spans: one row per token (here per == decode_tokens)
            by_span = host["row_token"][: n_spans * per].reshape(n_spans, per)
            by_span[decode] = q_start[decode, None] + np.arange(per)
            host["row_live"][: n_spans * per].reshape(n_spans, per)[decode] = 1
        for r, span in enumerate(spans):
            if span.tokens:
                host["ids"][q_start[r]: q_start[r] + lengths[r]] = span.tokens
        block_start, block_len = q_block_arrays(np.asarray(lengths, dtype=np.int64), q_start, g.q_block)
        host["q_block_start"][: len(block_start)] = block_start
        host["q_block_len"][: len(block_len)] = block_len

    def _level_size(self, level: str, g: Geometry) -> int:
        return {"tokens": g.tokens, "spans": g.spans + 1, "rows": g.rows, "blocks": g.q_blocks}[level]

