"""PLACEHOLDER until the varlen kernel lands: per-token rows through the decode kernel."""

from __future__ import annotations

import torch

from graphrelay.capture.kernels.attention import decode_attention

Q_BLOCK = 16


def max_q_blocks(tokens: int, spans: int) -> int:
    return tokens // Q_BLOCK + spans


def q_blocks(span_lengths, span_starts):
    starts, lens = [], []
    for n, s in zip(span_lengths, span_starts):
        for off in range(0, n, Q_BLOCK):
            starts.append(s + off)
            lens.append(min(Q_BLOCK, n - off))
    return starts, lens


def varlen_attention(q, k_cache, v_cache, block_table, token_slot, token_pos, q_block_start, q_block_len, *,
                     scale, out, workspace=None, num_splits=None, backend=None):
    return decode_attention(q, k_cache, v_cache, token_slot, token_pos, scale=scale, out=out, workspace=workspace,
                            backend=backend)


def identity_block_table(num_slots, max_seq_len, device):
    return torch.zeros(num_slots, 1, dtype=torch.int32, device=device)
