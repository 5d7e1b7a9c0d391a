"""Shared inputs and oracle of the attention tests: flat mixed batches of spans laid out as the
engine lays them out, caches stored through a permuted block table, and a per-token softmax loop
in float64 that knows nothing of pages, q-blocks or splits."""

from __future__ import annotations

import torch

from graphrelay.capture.kernels.q_blocks import Q_BLOCK, max_q_blocks, q_blocks


def naive_attention(q, k_cache, v_cache, slots, positions, scale):
    """Independent oracle: one row and one head at a time, in float64, over exactly the
    visible keys of the (logical) cache. Returns [n, h * d] float64."""
    n, heads, head_dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty(n, heads, head_dim, dtype=torch.float64)
    for i in range(n):
        slot, length = int(slots[i]), int(positions[i]) + 1
        for j in range(heads):
            keys = k_cache[slot, :length, j // group].double().cpu()  # [length, d]
            values = v_cache[slot, :length, j // group].double().cpu()
            weights = torch.softmax(keys @ q[i, j].double().cpu() * scale, dim=0)  # [length]
            out[i, j] = weights @ values
    return out.reshape(n, heads * head_dim)


def random_cache(num_slots, max_seq_len, kv_heads, head_dim, dtype, device="cpu", seed=0):
    """Logical K and V caches `[num_slots, max_seq_len, kv_heads, head_dim]`."""
    generator = torch.Generator(device).manual_seed(seed)
    shape = (num_slots, max_seq_len, kv_heads, head_dim)
    return tuple(torch.randn(shape, generator=generator, device=device).to(dtype) for _ in range(2))


def permuted_pages(cache, page, seed=0):
    """The cache stored as randomly placed pages: returns `(physical, block_table)` such that
    reading `physical` through `block_table` gives back `cache`."""
    num_slots, max_seq_len = cache.shape[:2]
    generator = torch.Generator().manual_seed(seed)
    place = torch.randperm(num_slots * max_seq_len // page, generator=generator).to(cache.device)
    physical = torch.empty_like(cache)
    physical.view(-1, page, *cache.shape[2:])[place] = cache.reshape(-1, page, *cache.shape[2:])
    return physical, place.int().view(num_slots, -1)


def flat_batch(spans, *, heads, head_dim, dtype, device="cpu", padding_tokens=0, block_order=None, seed=1,
               q_block=Q_BLOCK):
    """Lay out spans `(slot, cached, length)` as consecutive flat tokens (span i's tokens at
    positions `cached .. cached + length - 1`), then `padding_tokens` on slot 0, position 0.
    Returns varlen_attention's batch arguments plus `covered` ([T] bool: not padding).
    `block_order` permutes the q-blocks (padding blocks included) to show order is free;
    `q_block` is the tokens per q-block (pass the same to varlen_attention)."""
    token_slot, token_pos, starts, lengths = [], [], [], []
    for slot, cached, length in spans:
        starts.append(len(token_slot))
        lengths.append(length)
        token_slot += [slot] * length
        token_pos += range(cached, cached + length)
    covered = [True] * len(token_slot) + [False] * padding_tokens
    token_slot += [0] * padding_tokens
    token_pos += [0] * padding_tokens
    num_blocks = max_q_blocks(len(token_slot), len(spans), q_block)
    block_start, block_len = q_blocks(lengths, starts, num_blocks, q_block)
    if block_order is not None:
        block_start = [block_start[i] for i in block_order]
        block_len = [block_len[i] for i in block_order]
    generator = torch.Generator(device).manual_seed(seed)
    q = torch.randn(len(token_slot), heads, head_dim, generator=generator, device=device).to(dtype)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return {"q": q, "token_slot": ints(token_slot), "token_pos": ints(token_pos),
            "q_block_start": ints(block_start), "q_block_len": ints(block_len),
            "covered": torch.tensor(covered, device=device)}


def capture_after_warmup(step) -> torch.cuda.CUDAGraph:
    """Run `step` once on a side stream (Triton compiles and loads outside the capture), then
    capture it into a CUDA graph and return the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
