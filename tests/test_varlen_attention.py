"""Varlen attention on CPU: the Triton kernel under the interpreter against the torch reference
and an independent per-token loop over random span mixes (decode rows, verify spans, prefill
chunks over cached prefixes; GQA; padding; permuted block tables; splits), equality with the
decode and prefill attention it replaces, the host helpers, the workspace, and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_cases import flat_batch, naive_attention, permuted_pages, random_cache
from graphrelay.capture.kernels.attention import decode_attention_reference, prefill_attention
from graphrelay.capture.kernels.q_blocks import Q_BLOCK, max_q_blocks, q_blocks
from graphrelay.capture.kernels.varlen_attention import (
    DECODE_KEY_TILE,
    PAGE,
    REGISTERS_PER_SM,
    WARPS,
    WIDE_DECODE_PROGRAMS_PER_SM,
    VarlenWorkspace,
    identity_block_table,
    key_tile,
    pick_varlen_splits,
    register_cap,
    varlen_attention,
)
from graphrelay.lint import lint_step

NUM_SLOTS = 5  # slot 0 padding + 4 requests
MAX_SEQ_LEN = 160  # three key tiles of 64, the last partial
HEAD_DIM = 16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SENTINEL = float("nan")  # what `out` holds before the call: padding tokens must keep it


def run(batch, k_cache, v_cache, table, *, backend, scale=0.25, **options):
    q = batch["q"]
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), SENTINEL, dtype=q.dtype)
    args = {key: value for key, value in batch.items() if key != "covered"}
    return varlen_attention(k_cache=k_cache, v_cache=v_cache, block_table=table, scale=scale, out=out,
                            backend=backend, **args, **options)


def assert_padding_untouched(out, covered):
    assert out[~covered].isnan().all()
    assert torch.isfinite(out[covered]).all()


@st.composite
def span_mixes(draw):
    """Up to four spans on distinct slots: decode rows (1), verify spans (2-4), prefill chunks
    (5-40, so up to three q-blocks), each after a random cached prefix."""
    slots = draw(st.permutations(range(1, NUM_SLOTS)))[: draw(st.integers(1, NUM_SLOTS - 1))]
    spans = []
    for slot in slots:
        length = draw(st.sampled_from([1, 2, 4]) | st.integers(5, 40))
        spans.append((slot, draw(st.integers(0, MAX_SEQ_LEN - length)), length))
    return spans


@settings(max_examples=12, deadline=None)
@given(
    spans=span_mixes(),
    group=st.sampled_from([1, 2, 4]),
    kv_heads=st.sampled_from([1, 2]),
    padding_tokens=st.integers(0, 3),
    page=st.sampled_from([8, PAGE, 32]),
    permuted=st.booleans(),
    tableless=st.booleans(),
    num_splits=st.sampled_from([1, 2, 3]),
    q_block=st.sampled_from([1, 4, Q_BLOCK]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    settled=st.booleans(),
    data=st.data(),
)
def test_triton_matches_reference_and_naive_loop(spans, group, kv_heads, padding_tokens, page, permuted,
                                                 tableless, num_splits, q_block, dtype, settled, data):
    heads = group * kv_heads
    num_tokens = sum(length for *_, length in spans) + padding_tokens
    order = data.draw(st.permutations(range(max_q_blocks(num_tokens, len(spans), q_block))), label="block order")
    batch = flat_batch(spans, heads=heads, head_dim=HEAD_DIM, dtype=dtype, padding_tokens=padding_tokens,
                       block_order=order, q_block=q_block)
    k_logical, v_logical = random_cache(NUM_SLOTS, MAX_SEQ_LEN, kv_heads, HEAD_DIM, dtype)
    if permuted:
        (k_cache, table), (v_cache, _) = (permuted_pages(c, page, seed=3) for c in (k_logical, v_logical))
    else:
        # tableless: no table at all, each slot's own contiguous rows (what the identity table maps).
        k_cache, v_cache = k_logical, v_logical
        table = None if tableless else identity_block_table(NUM_SLOTS, MAX_SEQ_LEN, page)

    expected = run(batch, k_cache, v_cache, table, backend="torch", q_block=q_block)
    # One key tile per split: every block past its first tile splits (up to num_splits ways).
    # settled: the metadata loads move ahead of the PDL wait (GPU only); the arithmetic is the same.
    got = run(batch, k_cache, v_cache, table, backend="triton", num_splits=num_splits, q_block=q_block,
              split_tiles=1, metadata_settled=settled)
    covered = batch["covered"]
    assert_padding_untouched(expected, covered)
    assert_padding_untouched(got, covered)
    torch.testing.assert_close(got[covered], expected[covered], atol=TOLERANCE[dtype], rtol=0)
    # The oracle reads the logical cache directly: no pages, q-blocks or splits.
    naive = naive_attention(batch["q"][covered], k_logical, v_logical, batch["token_slot"][covered],
                            batch["token_pos"][covered], 0.25)
    torch.testing.assert_close(expected[covered].double(), naive, atol=2 * TOLERANCE[dtype], rtol=0)


# ----------------------------------------------------------------------------------------------
# Fixed cases: padding, the kernels it replaces


SPANS = [(1, 0, 20), (2, 50, 1), (3, 7, 3), (4, 80, 1)]  # a first chunk, decode, verify, decode
SHAPE = (4, 2)  # heads, kv_heads


def small_case(dtype=torch.float32, spans=SPANS, **layout):
    heads, kv_heads = SHAPE
    batch = flat_batch(spans, heads=heads, head_dim=HEAD_DIM, dtype=dtype, **layout)
    k_cache, v_cache = random_cache(NUM_SLOTS, MAX_SEQ_LEN, kv_heads, HEAD_DIM, dtype)
    return batch, k_cache, v_cache, identity_block_table(NUM_SLOTS, MAX_SEQ_LEN)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padding_blocks_leave_real_outputs_untouched(num_splits):
    batch, k_cache, v_cache, table = small_case(padding_tokens=8)
    real = int((batch["q_block_len"] > 0).sum())
    assert real < batch["q_block_len"].shape[0]  # max_q_blocks leaves padding blocks at the end
    # Without padding blocks, and with extra padding blocks in front pointing at real tokens.
    bare = {**batch, "q_block_start": batch["q_block_start"][:real], "q_block_len": batch["q_block_len"][:real]}
    padded = {**batch, "q_block_start": torch.cat((torch.tensor([0, 5, 21], dtype=torch.int32), batch["q_block_start"])),
              "q_block_len": torch.cat((torch.zeros(3, dtype=torch.int32), batch["q_block_len"]))}
    outputs = [run(b, k_cache, v_cache, table, backend="triton", num_splits=num_splits) for b in (bare, batch, padded)]
    for other in outputs[1:]:  # bit-equal, the untouched NaN padding tokens included
        torch.testing.assert_close(other, outputs[0], atol=0, rtol=0, equal_nan=True)


def test_padding_tokens_are_left_as_they_were():
    batch, k_cache, v_cache, table = small_case(padding_tokens=4)
    for backend in ("torch", "triton"):
        out = run(batch, k_cache, v_cache, table, backend=backend)
        assert_padding_untouched(out, batch["covered"])


@pytest.mark.parametrize("q_block", [1, Q_BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_decode_batch_equals_decode_reference(dtype, q_block):
    rows = [(1, 0), (2, 61), (3, MAX_SEQ_LEN - 1), (4, 64), (0, 0)]
    batch, k_cache, v_cache, table = small_case(dtype, spans=[(slot, pos, 1) for slot, pos in rows], q_block=q_block)
    assert batch["q_block_len"].shape[0] == len(rows)  # decode-only: one block per token, no padding
    expected = decode_attention_reference(batch["q"], k_cache, v_cache, batch["token_slot"], batch["token_pos"],
                                          scale=0.25)
    assert torch.equal(run(batch, k_cache, v_cache, table, backend="torch", q_block=q_block), expected)
    for num_splits in (1, 2):
        got = run(batch, k_cache, v_cache, table, backend="triton", num_splits=num_splits, q_block=q_block)
        torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("q_block, num_splits", [(1, 1), (1, 2), (Q_BLOCK, 1), (Q_BLOCK, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_cache_widens_to_the_model_dtype(dtype, q_block, num_splits):
    # An opt-in float8 cache (capture.model.kv_cache): both backends widen each K/V value to
    # q's dtype as they read it, so they equal attention over that widened cache, and the
    # oracle reading the float8 values directly.
    batch, k_model, v_model, table = small_case(dtype, q_block=q_block)
    k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_model, v_model))
    widened = [c.to(dtype) for c in (k_cache, v_cache)]
    expected = run(batch, *widened, table, backend="torch", q_block=q_block)
    assert torch.equal(run(batch, k_cache, v_cache, table, backend="torch", q_block=q_block), expected)
    got = run(batch, k_cache, v_cache, table, backend="triton", q_block=q_block, num_splits=num_splits, split_tiles=1)
    covered = batch["covered"]
    torch.testing.assert_close(got[covered], expected[covered], atol=TOLERANCE[dtype], rtol=0)
    naive = naive_attention(batch["q"][covered], k_cache, v_cache, batch["token_slot"][covered],
                            batch["token_pos"][covered], 0.25)
    torch.testing.assert_close(expected[covered].double(), naive, atol=2 * TOLERANCE[dtype], rtol=0)
    # The float8 values are not the model's: the cache's rounding shows in the output.
    assert not torch.equal(expected[covered], run(batch, k_model, v_model, table, backend="torch",
                                                  q_block=q_block)[covered])


def test_longer_blocks_than_q_block_are_clamped_to_it():
    # A caller bug (a block of 20 tokens with q_block 4) computes the first 4 tokens and
    # leaves the rest untouched, in both backends: no row outside the built ones is written.
    batch, k_cache, v_cache, table = small_case(spans=[(1, 0, 20)])
    bad = {**batch, "q_block_start": torch.tensor([0], dtype=torch.int32),
           "q_block_len": torch.tensor([20], dtype=torch.int32)}
    for backend in ("torch", "triton"):
        out = run(bad, k_cache, v_cache, table, backend=backend, q_block=4)
        assert torch.isfinite(out[:4]).all() and out[4:].isnan().all()


@pytest.mark.parametrize("cached", [0, 37])
def test_single_chunk_equals_prefill_attention(cached):
    slot, length = 3, 40
    batch, k_cache, v_cache, table = small_case(spans=[(slot, cached, length)])
    expected = prefill_attention(batch["q"][None], k_cache, v_cache, torch.tensor([slot]), torch.tensor([cached]),
                                 torch.tensor([length]), scale=0.25)[0]
    for backend in ("torch", "triton"):
        torch.testing.assert_close(run(batch, k_cache, v_cache, table, backend=backend), expected,
                                   atol=1e-5, rtol=0)


def test_reads_strided_q_and_honours_max_len():
    # q as split out of a fused qkv projection: row stride (h + 2 kvh) * d, not h * d.
    batch, k_cache, v_cache, table = small_case(spans=[(1, 3, 20), (2, 30, 1)])
    heads, kv_heads = SHAPE
    qkv = torch.randn(batch["q"].shape[0], (heads + 2 * kv_heads) * HEAD_DIM)
    strided = {**batch, "q": qkv[:, : heads * HEAD_DIM].view(-1, heads, HEAD_DIM)}
    assert not strided["q"].is_contiguous()
    expected = run({**batch, "q": strided["q"].contiguous()}, k_cache, v_cache, table, backend="torch")
    torch.testing.assert_close(run(strided, k_cache, v_cache, table, backend="triton", num_splits=2), expected,
                               atol=1e-5, rtol=0)
    # Every position < 32: a 32-key gather gives the same answer as the whole cache.
    assert torch.equal(run(strided, k_cache, v_cache, table, backend="torch", max_len=32), expected)


def test_reference_is_capturable():
    batch, k_cache, v_cache, table = small_case(padding_tokens=2)
    out = torch.empty(batch["q"].shape[0], SHAPE[0] * HEAD_DIM)
    names = ("q", "token_slot", "token_pos", "q_block_start", "q_block_len")

    def step(*tensors):
        return varlen_attention(*tensors[:1], k_cache, v_cache, table, *tensors[1:], scale=0.25, out=out)

    # Other in-range values, q-blocks included, must run the same ops with the same shapes.
    other = flat_batch([(4, 60, 20), (1, 0, 1), (2, 90, 3), (3, 5, 1)], heads=SHAPE[0], head_dim=HEAD_DIM,
                       dtype=torch.float32, padding_tokens=2, seed=5)
    report = lint_step(step, [batch[n] for n in names], alt_inputs=[other[n] for n in names])
    assert report.ok, report.findings
    assert report.ops_recorded > 0


# ----------------------------------------------------------------------------------------------
# Host helpers, split count, workspace


def test_q_blocks_split_spans_and_pad():
    starts, lens = q_blocks([1, 40, 16, 3], [0, 1, 41, 57], num_blocks=8)
    assert starts == [0, 1, 1 + Q_BLOCK, 1 + 2 * Q_BLOCK, 41, 57, 0, 0]
    assert lens == [1, Q_BLOCK, Q_BLOCK, 40 - 2 * Q_BLOCK, 16, 3, 0, 0]
    assert q_blocks([1, 5], [0, 1], q_block=2) == ([0, 1, 3, 5], [1, 2, 2, 1])
    with pytest.raises(ValueError, match="q_block must be"):
        q_blocks([1], [0], q_block=0)
    with pytest.raises(ValueError, match="max_q_blocks"):
        q_blocks([40], [0], num_blocks=2)
    with pytest.raises(ValueError, match="length >= 1"):
        q_blocks([0], [0])
    with pytest.raises(ValueError, match="differ in length"):
        q_blocks([1, 2], [0])


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=20), spare=st.integers(0, 40),
       q_block=st.sampled_from([1, 3, Q_BLOCK]))
def test_max_q_blocks_bounds_every_batch_of_its_bucket(lengths, spare, q_block):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    tokens = sum(lengths) + spare
    num_blocks = max_q_blocks(tokens, len(lengths), q_block)
    block_start, block_len = q_blocks(lengths, starts, num_blocks, q_block)
    # Every token of every span in exactly one block of one span.
    covered = sorted(t for start, length in zip(block_start, block_len) for t in range(start, start + length))
    assert covered == list(range(sum(lengths)))
    assert all(0 <= length <= q_block for length in block_len)


@pytest.mark.parametrize("num_splits,q_block", [(1, 1), (3, 1), (1, Q_BLOCK), (2, Q_BLOCK)])
def test_no_table_reads_what_the_identity_table_maps_bit_for_bit(num_splits, q_block):
    batch, k_cache, v_cache, table = small_case(torch.bfloat16, q_block=q_block)
    for backend in ("torch", "triton"):
        options = dict(backend=backend, q_block=q_block, **({"num_splits": num_splits, "split_tiles": 1}
                                                           if backend == "triton" else {}))
        paged = run(batch, k_cache, v_cache, table, **options)
        tableless = run(batch, k_cache, v_cache, None, **options)
        torch.testing.assert_close(tableless, paged, atol=0, rtol=0, equal_nan=True)


def test_identity_block_table():
    table = identity_block_table(3, 64, 16)
    assert table.dtype == torch.int32 and table.shape == (3, 4)
    assert table[2].tolist() == [8, 9, 10, 11]
    with pytest.raises(ValueError, match="divide"):
        identity_block_table(3, 60, 16)


def test_splits_only_for_small_buckets():
    # SmolLM2 on an H200: 3 KV heads, 2048 keys, 132 SMs. Buckets by growing q-block count.
    buckets = [(1, 1), (16, 16), (64, 64), (2048, 1), (256, 256), (8192, 64)]
    blocks = [max_q_blocks(tokens, spans) for tokens, spans in buckets]
    assert blocks == sorted(blocks)
    counts = [pick_varlen_splits(n, 3, 2048, 132) for n in blocks]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > 1 and counts[-2:] == [1, 1]


def test_workspace_for_buckets_fits_every_bucket():
    buckets = [(1, 1), (64, 64), (256, 256), (128, 8), (2048, 1)]
    workspace = VarlenWorkspace.for_buckets(buckets, 9, 3, 64, 2048, "cpu", sm_count=132)
    needs = [(tokens, pick_varlen_splits(max_q_blocks(tokens, spans), 3, 2048, 132)) for tokens, spans in buckets]
    assert workspace.max_splits == max(splits for _, splits in needs)
    assert workspace.capacity >= max(tokens * splits for tokens, splits in needs)
    assert workspace.capacity < max(tokens * splits for tokens, splits in needs) + workspace.max_splits
    for tokens, splits in needs:
        assert workspace.splits_that_fit(tokens, splits) == splits
        partial, lse = workspace.views(tokens, 9, 64, splits)
        assert partial.shape == (tokens, 9, splits, 64) and lse.shape == (tokens, 9, splits)


def test_the_last_split_merges_and_leaves_the_counters_zero_for_the_next_call():
    """Split programs count themselves done; the last merges and resets its counter, so one
    workspace serves call after call (every layer, every bucket) with no reset node."""
    # Blocks walking 1, 2 and 3 key tiles: with a tile per split they use 1, 2 and 3 splits.
    batch, k_cache, v_cache, table = small_case(spans=[(1, 0, 20), (2, 150, 1), (3, 100, 30), (4, 80, 1)])
    tokens = batch["q"].shape[0]
    workspace = VarlenWorkspace(tokens, SHAPE[0], HEAD_DIM, 3, "cpu")
    expected = run(batch, k_cache, v_cache, table, backend="torch")
    for num_splits in (3, 2, 3):
        got = run(batch, k_cache, v_cache, table, backend="triton", num_splits=num_splits, workspace=workspace,
                  split_tiles=1)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert not workspace.done.any(), workspace.done.nonzero()


def test_decode_grids_pick_their_tiles_and_splits_by_width():
    # 132 SMs and SmolLM2's 3 KV heads (the H100 / H200 this was measured on), 768 keys.
    assert key_tile(Q_BLOCK, 2, 64, 132) == key_tile(Q_BLOCK, 1, 10, 132) == 64  # prompt buckets
    assert key_tile(1, 1, 256 * 3, 132) == key_tile(1, 1, 176 * 3, 132) == 64  # wide decode grids
    assert key_tile(1, 1, 128 * 3, 132) == key_tile(1, 3, 16 * 3, 132) == DECODE_KEY_TILE == 128  # narrow ones
    # Decode-only buckets split until the grid has one program per SM; prompt buckets, four.
    assert [pick_varlen_splits(n, 3, 768, 132, q_block=1) for n in (1, 16, 32, 44, 64, 256)] == [6, 3, 2, 1, 1, 1]
    assert [pick_varlen_splits(n, 3, 768, 132) for n in (16, 64, 256)] == [6, 3, 1]


def test_wide_decode_grids_are_capped_to_fit_six_programs_an_sm():
    # 80 registers x 128 threads x 6 programs fits the 65,536-register file; 88 would not.
    cap = register_cap(1, 1, 256 * 3, 132)
    assert cap == 80 and cap * WARPS * 32 * WIDE_DECODE_PROGRAMS_PER_SM <= REGISTERS_PER_SM
    assert (cap + 8) * WARPS * 32 * WIDE_DECODE_PROGRAMS_PER_SM > REGISTERS_PER_SM
    assert register_cap(1, 1, 176 * 3, 132) == 80  # the narrowest grid that keeps 64-key tiles
    # Narrow decode grids, split ones and prompt buckets keep the compiler's own allocation.
    assert register_cap(1, 1, 128 * 3, 132) is None
    assert register_cap(1, 2, 256 * 3, 132) is None
    assert register_cap(Q_BLOCK, 1, 256 * 3, 132) is None


def test_decode_blocks_that_split_walk_wide_key_tiles_and_match_the_reference():
    """q-blocks of one token under splits take 128-key tiles (key_tile): decodes ending inside
    the first tile, on its last key, and in the partial second tile, split 2 and 3 ways."""
    spans = [(1, 20, 1), (2, 127, 1), (3, 128, 1), (4, 159, 1)]
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, TOLERANCE[torch.bfloat16])):
        batch, k_cache, v_cache, table = small_case(dtype=dtype, spans=spans, q_block=1)
        expected = run(batch, k_cache, v_cache, table, backend="torch", q_block=1)
        for num_splits in (2, 3):
            workspace = VarlenWorkspace(len(spans), SHAPE[0], HEAD_DIM, num_splits, "cpu")
            got = run(batch, k_cache, v_cache, table, backend="triton", num_splits=num_splits, q_block=1,
                      workspace=workspace, split_tiles=1)
            torch.testing.assert_close(got, expected, atol=atol, rtol=0)
            assert not workspace.done.any()


def test_a_grid_with_more_splits_than_a_walk_needs_gives_the_same_bits():
    """A decode row uses one split per key tile it walks, up to the grid's count: any grid at
    least that wide merges the same partials in the same order (so lowering the split count of
    short-context buckets changes no output bit)."""
    spans = [(1, 20, 1), (2, 127, 1), (3, 128, 1), (4, 159, 1)]  # 1, 1, 2 and 2 key tiles of 128
    batch, k_cache, v_cache, table = small_case(dtype=torch.bfloat16, spans=spans, q_block=1)
    outputs = []
    for num_splits in (2, 3, 5):
        workspace = VarlenWorkspace(len(spans), SHAPE[0], HEAD_DIM, num_splits, "cpu")
        outputs.append(run(batch, k_cache, v_cache, table, backend="triton", num_splits=num_splits, q_block=1,
                           workspace=workspace, split_tiles=1))
    for other in outputs[1:]:
        assert torch.equal(other, outputs[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_merging_up_to_eight_splits_match_the_reference(dtype):
    """Decode rows walking 1, 3, 5 and 8 key tiles of 128 under a grid of 8 splits: the last
    split to finish merges 1, 3, 5 and 8 partials (a one-row decode over a long context splits
    this wide), and every row matches the reference."""
    max_seq_len, heads, kv_heads = 1024, 4, 2
    spans = [(1, 9, 1), (2, 300, 1), (3, 600, 1), (4, 1023, 1)]  # keys 0 ..= position
    batch = flat_batch(spans, heads=heads, head_dim=HEAD_DIM, dtype=dtype, q_block=1)
    k_cache, v_cache = random_cache(NUM_SLOTS, max_seq_len, kv_heads, HEAD_DIM, dtype)
    table = identity_block_table(NUM_SLOTS, max_seq_len)
    expected = run(batch, k_cache, v_cache, table, backend="torch", q_block=1)
    workspace = VarlenWorkspace(len(spans), heads, HEAD_DIM, 8, "cpu")
    got = run(batch, k_cache, v_cache, table, backend="triton", num_splits=8, q_block=1, workspace=workspace,
              split_tiles=1)
    torch.testing.assert_close(got, expected, atol=1e-5 if dtype == torch.float32 else TOLERANCE[dtype], rtol=0)
    assert not workspace.done.any()


def test_workspace_caps_and_rejects():
    batch, k_cache, v_cache, table = small_case()
    tokens = batch["q"].shape[0]
    workspace = VarlenWorkspace(tokens, SHAPE[0], HEAD_DIM, 2, "cpu")
    workspace.lse.fill_(SENTINEL)
    got = run(batch, k_cache, v_cache, table, backend="triton", num_splits=2, workspace=workspace, split_tiles=1)
    torch.testing.assert_close(got, run(batch, k_cache, v_cache, table, backend="torch"), atol=1e-5, rtol=0)
    # The blocks that split (past their first tile: the decode at 80) wrote their cells of
    # the [T, h, 2] prefix; the blocks that did not, none.
    cells = workspace.lse.view(tokens, SHAPE[0], 2)
    split = batch["token_pos"] >= 64
    assert split.any() and not cells[split].isnan().any() and cells[~split].isnan().all()
    assert workspace.splits_that_fit(tokens, 16) == 2 and workspace.splits_that_fit(2 * tokens, 2) == 1
    with pytest.raises(ValueError, match="for_buckets"):
        run(batch, k_cache, v_cache, table, backend="triton", num_splits=3, workspace=workspace)
    wrong = VarlenWorkspace(tokens, SHAPE[0] + 1, HEAD_DIM, 2, "cpu")
    with pytest.raises(ValueError, match="heads"):
        run(batch, k_cache, v_cache, table, backend="triton", num_splits=2, workspace=wrong)


# ----------------------------------------------------------------------------------------------
# Bad input


def _bad_cache(args):
    k_cache = args["k_cache"][:, :90]
    return {**args, "k_cache": k_cache, "v_cache": k_cache}


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "q": a["q"].double()}, "k_cache and v_cache must both be torch.float64 or torch.float8_e4m3fn"),
        (lambda a: {**a, "v_cache": a["v_cache"].to(torch.float8_e4m3fn)}, "got torch.float32 and torch.float8_e4m3fn"),
        (lambda a: {**a, "k_cache": a["k_cache"].to(torch.int8), "v_cache": a["v_cache"].to(torch.int8)},
         "must both be torch.float32 or torch.float8_e4m3fn for q of torch.float32, got torch.int8"),
        (lambda a: {**a, "token_pos": a["token_pos"][:-1]}, "token_pos must be"),
        (lambda a: {**a, "token_slot": a["token_slot"].float()}, "token_slot must be int32 or int64"),
        (lambda a: {**a, "block_table": a["block_table"][:, :3]}, "block_table must be"),
        (lambda a: {**a, "block_table": a["block_table"].float()}, "block_table must be int32"),
        (lambda a: {**a, "q_block_len": a["q_block_len"][:-1]}, "q_block_start and q_block_len"),
        (lambda a: {**a, "q_block_start": a["q_block_start"].to(torch.int16)}, "q_block_start must be int32"),
        (_bad_cache, "contiguous over \\[slot, position\\]"),
        (lambda a: {**a, "out": a["out"][:, :-1]}, "out must be"),
        (lambda a: {**a, "out": None}, "out is required"),
        (lambda a: {**a, "max_len": MAX_SEQ_LEN + 1}, "max_len"),
        (lambda a: {**a, "q": torch.stack((a["q"], a["q"]), dim=-1)[..., 0]}, "unit-stride"),
        (lambda a: {**a, "backend": "cuda"}, "backend must be"),
        (lambda a: {**a, "num_splits": 0}, "num_splits"),
        (lambda a: {**a, "split_tiles": 0}, "split_tiles"),
    ],
)
def test_rejects_bad_arguments(change, match):
    batch, k_cache, v_cache, table = small_case()
    out = torch.full((batch["q"].shape[0], SHAPE[0] * HEAD_DIM), SENTINEL)
    args = {**{k: v for k, v in batch.items() if k != "covered"}, "k_cache": k_cache, "v_cache": v_cache,
            "block_table": table, "out": out, "backend": "triton"}
    with pytest.raises(ValueError, match=match):
        varlen_attention(**change(args), scale=0.25)
    assert out.isnan().all()  # nothing written
