"""The logprob channel's Triton write (TRITON_INTERPRET=1 on CPU) against the torch reference:
the same ring contents over shapes, vocabularies not a multiple of the chunk, many ties and
-inf logits; and the Triton path's tie rule (lowest token id first)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrelay.capture.iteration.controls.logprobs import CHUNK, LogprobChannel
from graphrelay.capture.iteration.controls.state import ControlsConfig, SamplingControls
from controls_cases import assert_same_logprobs

DEPTH, MAX_ROWS = 3, 6


def write_both(logits, tokens, row_slots, iteration: int, width: int, max_rows: int = MAX_ROWS):
    """(triton, torch) channels after one write of the rows at mirror iteration `iteration`."""
    channels = [LogprobChannel(max_rows, DEPTH, torch.device("cpu"), logits.shape[1], backend, width)
                for backend in ("triton", "torch")]
    for c in channels:
        c.write(row_slots, logits, tokens, torch.tensor([iteration]))
    return channels


def stable_top_ids(logits, width):
    """The top `width` ids with ties in ascending id order: the Triton path's rule."""
    return torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :width]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, MAX_ROWS), width=st.integers(1, 20),
       vocab=st.integers(20, 5000).filter(lambda v: v % CHUNK != 0), iteration=st.integers(0, 7),
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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_controls_backend_picks_the_channel_write(backend):
    c = SamplingControls(ControlsConfig(backend=backend), max_reqs=2, vocab_size=300, max_rows=2, device="cpu")
    assert c.logprobs.backend == backend
    torch.manual_seed(1)
    logits = torch.randn(2, 300)
    c.write_logprobs(torch.tensor([1, 2]), logits, torch.tensor([7, 8]), torch.zeros(1, dtype=torch.int64))
    torch.testing.assert_close(c.logprobs.host["values"][0, :2, 0], torch.log_softmax(logits, 1)[[0, 1], [7, 8]])


def test_triton_write_refuses_logits_it_was_not_sized_for():
    channel = LogprobChannel(2, DEPTH, torch.device("cpu"), 300, "triton")
    with pytest.raises(ValueError, match=r"\[<= 2, 300\]"):
        channel.write(torch.tensor([1]), torch.randn(1, 301), torch.tensor([0]), torch.zeros(1, dtype=torch.int64))
