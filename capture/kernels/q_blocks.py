"""Q-blocks: how the varlen attention kernel's work is cut from a flat batch's spans.

A span (a flat token range `[start, start + length)`: a decode row, a verify span or a prompt
chunk) becomes ceil(length / q_block) blocks of at most `q_block` consecutive tokens; a block
is one program's query rows (`capture.kernels.varlen_attention`). Host-side layout only: the
scheduler builds them every iteration (`q_block_arrays`), the buckets size them statically
(`max_q_blocks`).
"""

from __future__ import annotations

import numpy as np

Q_BLOCK = 16  # default query tokens per q-block: with the GQA group they make the dot's M


def check_q_block(q_block: int) -> None:
    if not isinstance(q_block, int) or isinstance(q_block, bool) or q_block < 1:
        raise ValueError(f"q_block must be a positive int (tokens per q-block), got {q_block!r}")


def max_q_blocks(tokens: int, spans: int, q_block: int = Q_BLOCK) -> int:
    """Static q-block count that any batch of at most `tokens` tokens in at most `spans` spans
    fits: sum(ceil(n_i / q)) <= sum(n_i // q + 1) <= tokens // q + spans, and <= tokens
    (a decode-only bucket needs exactly one block per token)."""
    check_q_block(q_block)
    return min(tokens, tokens // q_block + spans)


def q_blocks(span_lengths: list[int], span_starts: list[int], num_blocks: int | None = None,
             q_block: int = Q_BLOCK) -> tuple[list[int], list[int]]:
    """Split spans (flat token ranges `[start, start + length)`) into q-blocks of at most
    `q_block` tokens: returns `(starts, lens)` as host lists. With `num_blocks` (the bucket's
    `max_q_blocks`), pads with `(0, 0)` blocks to exactly that many."""
    check_q_block(q_block)
    if len(span_lengths) != len(span_starts):
        raise ValueError(f"span_lengths and span_starts differ in length: "
                         f"{len(span_lengths)} vs {len(span_starts)}")
    lengths, first = np.asarray(span_lengths, dtype=np.int64), np.asarray(span_starts, dtype=np.int64)
    bad = np.flatnonzero((lengths < 1) | (first < 0))
    if bad.size:
        raise ValueError(f"a span needs length >= 1 and start >= 0, got length {lengths[bad[0]]} at {first[bad[0]]}")
    starts, lens = q_block_arrays(lengths, first, q_block)
    if num_blocks is not None and len(starts) > num_blocks:
        raise ValueError(f"the spans need {len(starts)} q-blocks, more than num_blocks={num_blocks}: "
                         f"size num_blocks with max_q_blocks(tokens, spans, q_block)")
    padding = 0 if num_blocks is None else num_blocks - len(starts)
    return starts.tolist() + [0] * padding, lens.tolist() + [0] * padding


def q_block_arrays(lengths: np.ndarray, starts: np.ndarray, q_block: int) -> tuple[np.ndarray, np.ndarray]:
    """`q_blocks` without its checks or padding, on int64 arrays: the scheduler's path, where
    a per-block Python loop cost ~200 µs an iteration at 256 spans."""
    counts = -(-lengths // q_block)  # blocks per span
    span = np.repeat(np.arange(len(lengths)), counts)
    offset = (np.arange(span.size) - np.repeat(np.cumsum(counts) - counts, counts)) * q_block
    return starts[span] + offset, np.minimum(q_block, lengths[span] - offset)
