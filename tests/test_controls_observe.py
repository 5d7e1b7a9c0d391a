"""Recording emitted tokens: the one-launch Triton observe (interpreted here) against the torch
reference over random batches of decode rows and verify spans, with rows not emitted carrying
any token and state; and the reference's own rules by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrelay.capture.iteration.controls.observe import observe_torch, observe_triton

VOCAB, STATES, SLOTS = 37, 6, 5


def tables(seed: int):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (SLOTS + 1, VOCAB), generator=gen, dtype=torch.int32)
    next_state = torch.randint(0, STATES, (STATES, VOCAB), generator=gen, dtype=torch.int32)
    slot_state = torch.randint(0, STATES, (SLOTS + 2,), generator=gen, dtype=torch.int32)
    return counts, next_state, slot_state


@st.composite
def batches(draw):
    """Spans of consecutive rows per slot (distinct slots, padding slot 0 repeated), each
    emitting a prefix of its rows; rows not emitted hold garbage."""
    per = draw(st.integers(1, 4))
    spans = draw(st.lists(st.integers(0, SLOTS), min_size=1, max_size=SLOTS + 2))
    seen, slots, tokens, states, emitted = set(), [], [], [], []
    for slot in spans:
        if slot and slot in seen:
            slot = 0
        seen.add(slot)
        accepted = draw(st.integers(0 if slot == 0 else 1, per)) if slot else 0
        for j in range(per):
            emit = j < accepted
            slots.append(slot)
            emitted.append(emit)
            tokens.append(draw(st.integers(0, VOCAB - 1)) if emit else draw(st.sampled_from([-7, VOCAB + 3, 2**40])))
            states.append(draw(st.integers(0, STATES - 1)) if emit else draw(st.sampled_from([-1, STATES + 9])))
    return (torch.tensor(slots, dtype=torch.int32), torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(states, dtype=torch.int32), torch.tensor(emitted))


@settings(max_examples=40, deadline=None)
@given(batch=batches(), seed=st.integers(0, 2**16))
def test_triton_observe_equals_torch(batch, seed):
    want, got = tables(seed), tables(seed)
    observe_torch(*want, *batch)
    observe_triton(*got, *batch)
    assert torch.equal(got[0], want[0]), "counts"
    assert torch.equal(got[2][: SLOTS + 1], want[2][: SLOTS + 1]), "slot states (the sink row aside)"


def test_the_last_emitted_row_of_a_span_sets_the_state_and_every_emitted_row_counts():
    counts, next_state, slot_state = (t.zero_() for t in tables(0))
    next_state[2, 5], next_state[3, 6], next_state[4, 9] = 3, 4, 1
    # Slot 2 emits rows 0 and 1 of its span (row 2 rejected), slot 4 one decode row; padding.
    slots = torch.tensor([2, 2, 2, 4, 0], dtype=torch.int32)
    tokens = torch.tensor([5, 6, 9, 9, 3])
    states = torch.tensor([2, 3, 4, 4, 0], dtype=torch.int32)
    emitted = torch.tensor([True, True, False, True, False])
    for observe in (observe_torch, observe_triton):
        c, s = counts.clone(), slot_state.clone()
        observe(c, next_state, s, slots, tokens, states, emitted)
        assert s[2] == 4 and s[4] == 1 and s[0] == 0, observe.__name__
        assert c[2, 5] == c[2, 6] == c[4, 9] == 1 and c[2, 9] == 0 and int(c.sum()) == 3, observe.__name__


def test_triton_observe_refuses_strided_rows_before_launching():
    counts, next_state, slot_state = tables(1)
    slots = torch.tensor([1, 0, 2, 0], dtype=torch.int32)[::2]
    before = counts.clone()
    with pytest.raises(ValueError, match="row_slots must be \\[2\\] with unit stride"):
        observe_triton(counts, next_state, slot_state, slots, torch.tensor([3, 4]), torch.zeros(2, dtype=torch.int32),
                       torch.tensor([True, True]))
    assert torch.equal(counts, before)
