"""Debug mode: device-side checks for relay ops that run inside a CUDA graph.

Inside a capture, validating indices on the host would need a sync, so debug mode checks on
the device instead. Each slot carries a state per field (a write sets the fields it carries,
a resolve consumes the fields it reads, so subsets may be read at different points):

    UNWRITTEN  -- admitted (or never used) and not yet written: reading it is a bug
    FRESH      -- written since it was last read
    CONSUMED   -- read once already: reading again without a new write is a bug

A bad read (or an out-of-range index anywhere) records the first error in a small device
record `[code, slot, field_id, 0]` (when several rows of one launch fail, the torch path keeps
the lowest batch row's, the Triton kernel whichever program got there first); `Relay.check()` outside capture raises naming the slot
and the field. The kernels (Triton and torch) share these codes.
"""

from __future__ import annotations

UNWRITTEN, FRESH, CONSUMED = 0, 1, 2

ERR_NONE = 0
ERR_UNWRITTEN = 1  # read a row nobody wrote since the slot was admitted
ERR_CONSUMED = 2  # read a row twice without a write in between
ERR_OUT_OF_RANGE = 3  # index outside [0, max_reqs]
ERR_FIELD_INDICES = -1  # field id recorded with ERR_OUT_OF_RANGE

_EXPLAIN = {
    ERR_UNWRITTEN: (
        "was read before anything was written to it since the slot was admitted; stash/publish "
        "the slot (e.g. after prefill) before the iteration that resolves it"
    ),
    ERR_CONSUMED: (
        "was read twice without a write in between (consume-once); every resolve must follow "
        "a stash and publish of that slot by the previous iteration"
    ),
    ERR_OUT_OF_RANGE: (
        "is out of range [0, max_reqs]; the index is clamped to padding row 0 on the device, "
        "fix the slot indices fed to the graph"
    ),
}


class RelayDebugError(RuntimeError):
    """A debug-mode check failed on the device; raised by `Relay.check()` outside capture."""

    def __init__(self, code: int, slot: int, field: str):
        self.code, self.slot, self.field = code, slot, field
        what = f"slot index {slot}" if code == ERR_OUT_OF_RANGE else f"field {field!r} of slot {slot}"
        detail = _EXPLAIN.get(code, f"failed with unknown code {code}")
        super().__init__(f"relay debug check: {what} {detail}")
