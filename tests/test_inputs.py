"""The unified iteration's static input surface: fixed addresses, aligned fields, and the layout
of a flat batch of spans (tokens, spans, sampled rows, query blocks) padded to its bucket."""

from __future__ import annotations

import pytest
import torch

from graphrelay.capture.iteration.inputs import IterationInputs
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.spans import decode_span, prefill_span

SAMPLED = SamplingParams(temperature=0.5, top_k=7, seed=-3, top_p=0.9)


def layout(per: int = 1):
    inputs = IterationInputs(max_tokens=32, max_spans=8, rows_per_span=per, device="cpu")
    spans = [decode_span(4, SamplingParams()), prefill_span(2, SAMPLED, [11, 12, 13], 5, True),
             decode_span(7, SAMPLED), prefill_span(1, SamplingParams(), [21, 22], 0, False)]
    tokens = sum(len(s.tokens) or per for s in spans)
    inputs.load(spans, 16, per)
    return inputs, inputs.narrow(16), tokens


def test_fields_are_aligned_and_views_alias_the_buffers():
    inputs, view, _ = layout()
    for name, t in zip(view._fields, view):
        assert t.data_ptr() % 16 == 0, name
        assert t.data_ptr() == getattr(inputs.buffers, name).data_ptr(), name
    g = inputs.geometry(16)
    assert (view.token_span.shape[0], view.span_slot.shape[0], view.row_token.shape[0]) == (16, g.spans + 1, g.rows)


def test_a_mixed_batch_is_laid_out_span_by_span_then_padding():
    inputs, v, used = layout()
    assert used == 7
    # Tokens: decode(4) at 0, chunk(2) at 1..3, decode(7) at 4, chunk(1) at 5..6, then padding.
    assert v.token_span[:used].tolist() == [0, 1, 1, 1, 2, 3, 3]
    assert v.token_offset[:used].tolist() == [0, 0, 1, 2, 0, 0, 1]
    assert v.ids[1:4].tolist() == [11, 12, 13] and v.ids[5:7].tolist() == [21, 22]
    R = inputs.geometry(16).spans
    assert v.token_span[used:].tolist() == [R] * (16 - used)  # padding tokens -> the padding span
    assert v.span_slot[:5].tolist() == [4, 2, 7, 1, 0]
    assert v.span_decode[:4].tolist() == [1, 0, 1, 0] and v.span_samples[:4].tolist() == [1, 1, 1, 0]
    assert v.span_base[:4].tolist() == [0, 5, 0, 0]
    assert v.span_q_start[:4].tolist() == [0, 1, 4, 5] and v.span_q_start[4:].eq(32).all()
    assert v.row_token[:4].tolist() == [0, 3, 4, 6] and v.row_live[:4].tolist() == [1, 1, 1, 0]
    assert v.temperature[1].item() == 0.5 and v.top_k[2].item() == 7 and v.top_p[1].item() == pytest.approx(0.9)
    starts, lens = v.q_block_start.tolist(), v.q_block_len.tolist()
    covered = sorted(t for s, n in zip(starts, lens) for t in range(s, s + n))
    assert covered == list(range(used))  # every real token in exactly one block, no padding token


def test_verify_spans_get_one_sampled_row_per_token():
    inputs, v, used = layout(per=3)
    assert used == 3 + 3 + 3 + 2
    rows = v.row_token[:12].view(4, 3)
    live = v.row_live[:12].view(4, 3)
    assert rows[0].tolist() == [0, 1, 2] and live[0].tolist() == [1, 1, 1]  # verify span at 0..2
    assert rows[1, 0].item() == 5 and live[1].tolist() == [1, 0, 0]  # the chunk samples after its last token
    assert rows[2].tolist() == [6, 7, 8] and live[3].tolist() == [0, 0, 0]
    assert v.span_verify[:4].tolist() == [1, 0, 1, 0]


def test_a_smaller_load_leaves_no_stale_span_behind():
    inputs, _, _ = layout()
    inputs.load([decode_span(3, SamplingParams())], 2, 1)
    v = inputs.narrow(2)
    assert v.span_slot.tolist() == [3, 0, 0] and v.span_decode.tolist() == [1, 0, 0]
    assert v.token_span.tolist() == [0, 2] and v.row_live.tolist() == [1, 0]
    assert torch.equal(v.q_block_len.ne(0).sum(), torch.tensor(1))


def test_a_repeated_decode_load_lays_out_nothing_and_keeps_the_layout():
    inputs = IterationInputs(max_tokens=32, max_spans=8, rows_per_span=1, device="cpu")
    first = [decode_span(4, SamplingParams()), decode_span(6, SAMPLED)]
    inputs.load(first, 2, 1)
    v = inputs.narrow(2)
    v.ids[:2] = torch.tensor([101, 102])  # what the step writes there: the relay's tokens
    inputs.load(list(first), 2, 1)  # an equal list, not the same object
    assert inputs.loads_skipped == 1
    assert v.span_slot.tolist() == [4, 6, 0] and v.ids[:2].tolist() == [101, 102]
    # Another slot, another sampling param, another bucket: each is laid out again.
    for spans, bucket in (([decode_span(4, SamplingParams()), decode_span(7, SAMPLED)], 2),
                          ([decode_span(4, SamplingParams()), decode_span(6, SamplingParams())], 2),
                          ([decode_span(4, SamplingParams()), decode_span(6, SamplingParams())], 3)):
        inputs.load(spans, bucket, 1)
        assert inputs.loads_skipped == 1
        assert inputs.narrow(bucket).span_slot[:2].tolist() == [s.slot for s in spans]
    assert inputs.narrow(3).token_span.tolist() == [0, 1, inputs.geometry(3).spans]  # a padding token
    inputs.load([decode_span(4, SamplingParams()), decode_span(6, SamplingParams())], 3, 1)
    assert inputs.loads_skipped == 2


def test_a_load_with_a_prompt_chunk_is_always_laid_out():
    inputs = IterationInputs(max_tokens=32, max_spans=8, rows_per_span=1, device="cpu")
    spans = [decode_span(4, SamplingParams()), prefill_span(2, SAMPLED, [11, 12, 13], 5, True)]
    inputs.load(spans, 4, 1)
    v = inputs.narrow(4)
    v.ids[1:4] = 0
    v.span_slot[1] = 9
    inputs.load(spans, 4, 1)
    assert inputs.loads_skipped == 0
    assert v.ids[1:4].tolist() == [11, 12, 13] and v.span_slot[:2].tolist() == [4, 2]
    # A decode-only load after it is laid out too: the last layout was not this one.
    inputs.load([decode_span(4, SamplingParams())], 4, 1)
    inputs.load([decode_span(4, SamplingParams())], 4, 1)
    assert inputs.loads_skipped == 1 and v.span_slot[:2].tolist() == [4, 0]
