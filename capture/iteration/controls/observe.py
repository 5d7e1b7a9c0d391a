"""Recording what a step emitted: each emitted row's token counted for its slot, and its slot's
automaton advanced by it; a torch reference and one Triton launch.

Rows are the step's sampled rows (slot 0 = padding). Within a slot, emitted rows are
consecutive (a verify span's accepted prefix) and the last of them sets the slot's state:
the state after its token from the state the row was controlled in (`row_states`). A row not
emitted (padding, a rejected draft) changes nothing, whatever it sampled: its token may be
any value and is never used as an index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_tensors import check_row_tensors


def observe_torch(counts: torch.Tensor, next_state: torch.Tensor, slot_state: torch.Tensor, row_slots: torch.Tensor,
                  tokens: torch.Tensor, row_states: torch.Tensor, emitted: torch.Tensor) -> None:
    """counts [R + 1, V] int32, next_state [G, V] int32, slot_state [R + 2] int32 (the last
    entry a sink for the rows that set no state: index_copy_ needs one target per row)."""
    vocab, sink = counts.shape[1], slot_state.shape[0] - 1
    slots = row_slots.long()
    tokens = torch.where(emitted, tokens.long(), 0)
    states = torch.where(emitted, row_states.long(), 0)
    # Flat scatter-add: atomic adds, no sort and no sync (index_put_ with accumulate sorts).
    counts.view(-1).scatter_add_(0, slots * vocab + tokens, emitted.to(torch.int32))
    ends_run = torch.ones_like(emitted)
    ends_run[:-1] = ~((slots[1:] == slots[:-1]) & emitted[1:])
    target = torch.where(emitted & ends_run, slots, sink)
    slot_state.index_copy_(0, target, next_state[states, tokens])


@triton.jit
def _observe_kernel(counts_ptr, next_ptr, slot_state_ptr, slots_ptr, tokens_ptr, states_ptr, emitted_ptr, n, vocab):
    row = tl.program_id(0)
    if tl.load(emitted_ptr + row) != 0:
        slot = tl.load(slots_ptr + row).to(tl.int64)
        token = tl.load(tokens_ptr + row).to(tl.int64)
        # Atomic: a verify span's rows may emit the same token for one slot.
        tl.atomic_add(counts_ptr + slot * vocab + token, 1)
        has_next = row + 1 < n
        next_slot = tl.load(slots_ptr + row + 1, mask=has_next, other=-1).to(tl.int64)
        next_emitted = tl.load(emitted_ptr + row + 1, mask=has_next, other=0) != 0
        if (next_slot != slot) | (next_emitted == 0):  # the last emitted row of its slot's run
            state = tl.load(states_ptr + row).to(tl.int64)
            tl.store(slot_state_ptr + slot, tl.load(next_ptr + state * vocab + token))


def observe_triton(counts, next_state, slot_state, row_slots, tokens, row_states, emitted) -> None:
    """The same in one launch, one program per row; no torch ops (emitted: a bool tensor).
    The row tensors are read with unit stride: only their metadata is checked (capturable)."""
    n, vocab = row_slots.shape[0], counts.shape[1]
    check_row_tensors("observe_triton", n, row_slots=row_slots, tokens=tokens, row_states=row_states, emitted=emitted)
    _observe_kernel[(n,)](counts, next_state, slot_state, row_slots, tokens, row_states, emitted, n, vocab)
