"""The logprob channel's Triton write (TRITON_INTERPRET=1 on CPU) against the torch reference:
the same ring contents over shapes, vocabularies not a multiple of the chunk, many ties and
-inf logits; the Triton path's tie rule (lowest token id first); and rows whose slot did not
ask: skipped by Triton, read as None from both."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrelay.capture.iteration.controls.logprobs import CHUNK, GROUP, LogprobChannel
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig, SamplingControls
from graphrelay.mirror import MirrorRead
from controls_cases import assert_same_logprobs

DEPTH, MAX_ROWS = 3, 6


def write_both(logits, tokens, row_slots, iteration: int, width: int, max_rows: int = MAX_ROWS, wants=None):
    """(triton, torch) channels after one write of the rows at mirror iteration `iteration`;
    the ring's values start as nan (what a row not computed keeps)."""
    channels = [LogprobChannel(max_rows, DEPTH, torch.device("cpu"), logits.shape[1], backend, width)
                for backend in ("triton", "torch")]
    for c in channels:
        c.host["values"].fill_(float("nan"))
        c.write(row_slots, logits, tokens, torch.tensor([iteration]), wants)
    return channels


def read_at(iteration: int) -> MirrorRead:
    """A mirror read of `iteration` (the channel's read takes only its iteration)."""
    empty = torch.zeros(0, dtype=torch.int64)
    return MirrorRead(iteration=iteration, slots=empty, generation=empty, tokens=empty, seq_lens=empty,
                      stale=torch.zeros(0, dtype=torch.bool))


def stable_top_ids(logits, width):
    """The top `width` ids with ties in ascending id order: the Triton path's rule."""
    return torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :width]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, MAX_ROWS), width=st.integers(1, 20),
       vocab=st.integers(20, 2 * CHUNK + 500).filter(lambda v: v % CHUNK != 0), iteration=st.integers(0, 7),
       kind=st.sampled_from(["normal", "ties", "masked"]))
def test_triton_write_equals_torch(seed, n, width, vocab, iteration, kind):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 4
    if kind == "ties":
        logits = logits.round()
    elif kind == "masked":  # as a grammar mask leaves them (keep one finite logit per row)
        logits[torch.rand(n, vocab, generator=g) < 0.9] = float("-inf")
        logits[:, 0] = 1.0
    tokens = torch.randint(0, vocab, (n,), generator=g)
    row_slots = torch.randint(0, 5, (n,), generator=g, dtype=torch.int32)
    triton_channel, torch_channel = write_both(logits, tokens, row_slots, iteration, width)
    assert int(torch_channel.host["stamps"][iteration % DEPTH]) == iteration  # the reference did write
    assert_same_logprobs(logits, triton_channel, torch_channel, iteration % DEPTH)
    assert torch.equal(triton_channel.host["ids"][iteration % DEPTH, :n], stable_top_ids(logits, width))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_give_the_logprobs_of_their_float32_values(dtype):
    """The step writes logprobs from the LM head's own 16-bit output (ties are common there)."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, CHUNK + 300, generator=g) * 4).to(dtype)
    tokens = torch.randint(0, logits.shape[1], (4,), generator=g)
    row_slots = torch.tensor([1, 2, 0, 3], dtype=torch.int32)
    for got, want in zip(write_both(logits, tokens, row_slots, 1, 5), write_both(logits.float(), tokens, row_slots, 1, 5)):
        for name in ("values", "ids", "slots", "stamps"):  # ring slots not written stay nan in both
            torch.testing.assert_close(got.host[name], want.host[name], rtol=0, atol=0, equal_nan=True,
                                       msg=f"{got.backend} {name}")


def test_minus_zero_ties_plus_zero_lowest_id_first():
    """round() leaves -0.0 beside 0.0: equal values, so the lower id comes first whichever sign
    (the chunk's cut at `width` must not prefer +0.0: the second launch never sees what it drops)."""
    logits = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0], [1.0, 0.0, -0.0, 0.0, -0.0]])
    tokens, row_slots = torch.tensor([0, 1]), torch.tensor([1, 2], dtype=torch.int32)
    triton_channel, _ = write_both(logits, tokens, row_slots, 0, 2)
    assert triton_channel.host["ids"][0, :2].tolist() == [[0, 1], [0, 1]]
    assert torch.equal(triton_channel.host["ids"][0, :2], stable_top_ids(logits, 2))


def test_many_ties_keep_the_lowest_ids_across_chunks():
    """Five distinct values over 2.5 chunks: every top value is tied across chunk borders, so
    the second launch must order the chunks' candidates by id, not by arrival."""
    vocab, width = 2 * CHUNK + 1000, 20
    logits = (torch.arange(3 * vocab) % 5).float().reshape(3, vocab)
    logits[1] = logits[1].flip(0)
    tokens = torch.tensor([0, 4, vocab - 1])
    triton_channel, torch_channel = write_both(logits, tokens, torch.tensor([1, 2, 3]), 5, width)
    assert_same_logprobs(logits, triton_channel, torch_channel, 5 % DEPTH)
    ids = triton_channel.host["ids"][5 % DEPTH, :3]
    assert ids[0].tolist() == list(range(4, 5 * width, 5))  # value 4 at 4, 9, 14, ...
    assert torch.equal(ids, stable_top_ids(logits, width))


@pytest.mark.parametrize("layout", ["packed", "spread", "one per group"])
def test_top_values_packed_into_a_few_groups_or_spread_over_many(layout):
    """The first launch rounds over the groups with the largest maxima, then over their
    logits: the top `width` must come out whether they fill a few groups (packed: 2 * GROUP
    consecutive ids, so whole groups hold nothing but top values), sit one per group, or lie
    across a chunk border."""
    vocab, width = 2 * CHUNK + 100, 20
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, vocab, generator=g)
    if layout == "packed":
        top_ids = torch.arange(CHUNK - GROUP, CHUNK + GROUP)  # two groups each side of the border
    elif layout == "spread":
        top_ids = torch.randperm(vocab, generator=g)[:width]
    else:
        top_ids = torch.arange(width) * GROUP + GROUP - 1  # each group's last logit
    logits[:, top_ids] = 10.0 + torch.rand(len(top_ids), generator=g)
    tokens = torch.tensor([int(top_ids[0]), 0])
    triton_channel, torch_channel = write_both(logits, tokens, torch.tensor([1, 2]), 1, width)
    assert_same_logprobs(logits, triton_channel, torch_channel, 1)
    ids = triton_channel.host["ids"][1, :2]
    assert torch.equal(ids, stable_top_ids(logits, width))
    assert set(ids[0].tolist()) <= set(top_ids.tolist())


def test_minus_inf_logits_and_chunks_with_no_finite_logit():
    """Masked logits: a row with fewer finite logits than `width` (its top ends in -inf
    picks, which must still be -inf logits), and whole chunks of -inf (no nan in the sum)."""
    vocab, width = 3 * CHUNK + 7, 20
    logits = torch.randn(2, vocab)
    logits[0, : 2 * CHUNK] = float("-inf")
    logits[1] = float("-inf")
    finite = torch.tensor([3, CHUNK + 5, 3 * CHUNK + 6])
    logits[1, finite] = torch.tensor([0.5, 2.0, -1.0])
    tokens = torch.tensor([2 * CHUNK + 1, CHUNK + 5])
    triton_channel, torch_channel = write_both(logits, tokens, torch.tensor([4, 1]), 0, width)
    assert_same_logprobs(logits, triton_channel, torch_channel, 0)
    values, ids = triton_channel.host["values"][0, :2], triton_channel.host["ids"][0, :2]
    assert values[0].isfinite().all()
    assert ids[1, :3].tolist() == [CHUNK + 5, 3, 3 * CHUNK + 6]
    assert torch.isneginf(values[1, 4:]).all() and torch.isneginf(logits[1, ids[1, 3:]]).all()
    assert values[1, 0] == values[1, 1]  # the sampled token is the best one
    torch.testing.assert_close(values[1, 1:4].exp().sum(), torch.tensor(1.0))  # the 3 finite hold it all


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, MAX_ROWS), iteration=st.integers(0, 7))
def test_rows_whose_slot_does_not_want_logprobs_are_skipped_and_read_none(seed, n, iteration):
    """A batch mixing slots that want logprobs, slots that do not and padding: the asking rows
    equal the torch reference (which computes every row); the others are marked not asked in
    both, Triton computed nothing for them (their chunk results and ring values keep nan),
    and both read None for them, the same TokenLogprobs for the others."""
    g = torch.Generator().manual_seed(seed)
    vocab, width = 2 * CHUNK + 300, 5
    logits = torch.randn(n, vocab, generator=g) * 4
    tokens = torch.randint(0, vocab, (n,), generator=g)
    row_slots = torch.randint(0, 5, (n,), generator=g, dtype=torch.int32)
    wants = torch.tensor([0, 1, 0, 1, 0], dtype=torch.int32)  # slots 1 and 3 asked; 0 is padding
    triton_channel, torch_channel = write_both(logits, tokens, row_slots, iteration, width, wants=wants)
    ring_slot = iteration % DEPTH
    asked = wants[row_slots.long()].bool()
    assert torch.equal(torch_channel.host["asked"][ring_slot, :n].bool(), asked)
    assert_same_logprobs(logits, triton_channel, torch_channel, ring_slot)
    assert triton_channel.host["values"][ring_slot, :n][~asked].isnan().all()
    assert not torch_channel.host["values"][ring_slot, :n].isnan().any()  # the reference computes every row
    skipped = LogprobChannel(MAX_ROWS, DEPTH, torch.device("cpu"), vocab, "triton", width)
    skipped._chunk_max.fill_(float("nan"))
    skipped.write(row_slots, logits, tokens, torch.tensor([iteration]), wants)
    assert skipped._chunk_max[:n][~asked].isnan().all() and not skipped._chunk_max[:n][asked].isnan().any()
    got, want = triton_channel.read(read_at(iteration)), torch_channel.read(read_at(iteration))
    real = row_slots != 0
    assert [lp is not None for lp in got] == [lp is not None for lp in want] == asked[real].tolist()
    for a, b in zip(got, want):
        if a is not None:
            assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-5)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_controls_backend_picks_the_channel_write_for_the_slots_admitted_asking(backend):
    """SamplingControls flags a slot at admission (re-admission resets it): slot 1 asks, slot
    2 uses another control, so only slot 1's row reads logprobs (the log-softmax)."""
    c = SamplingControls(ControlsConfig(backend=backend), max_reqs=2, vocab_size=300, max_rows=2, device="cpu")
    assert c.logprobs.backend == backend
    c.admit(2, ControlParams(logprobs=1), (), [3])
    c.admit(2, ControlParams(presence_penalty=0.5), (), [3])
    c.admit(1, ControlParams(logprobs=2), (), [4])
    torch.manual_seed(1)
    logits = torch.randn(2, 300)
    c.write_logprobs(torch.tensor([1, 2]), logits, torch.tensor([7, 8]), torch.zeros(1, dtype=torch.int64))
    asking, other = c.logprobs.read(read_at(0))
    assert other is None
    assert asking.logprob == pytest.approx(float(torch.log_softmax(logits, 1)[0, 7]), rel=1e-5)


def test_triton_write_refuses_logits_it_was_not_sized_for():
    channel = LogprobChannel(2, DEPTH, torch.device("cpu"), 300, "triton")
    with pytest.raises(ValueError, match=r"\[<= 2, 300\]"):
        channel.write(torch.tensor([1]), torch.randn(1, 301), torch.tensor([0]), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"row_slots must be \[2\] with unit stride"):  # a broadcast view
        channel.write(torch.tensor([1]).expand(2), torch.randn(2, 300), torch.tensor([0, 1]),
                      torch.zeros(1, dtype=torch.int64))
