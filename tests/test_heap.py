"""The serving processes' heap freeze (`capture.serving.heap`): garbage alive at that moment is
collected, not frozen (a frozen cycle would never be freed), and what remains is moved out of
the collector's reach while serving, and handed back after."""

from __future__ import annotations

import gc
import weakref

from graphrelay.capture.serving.heap import frozen_startup_heap


class _Node:
    pass


def test_garbage_is_collected_and_the_rest_frozen():
    enabled = gc.isenabled()
    gc.disable()  # no collection of its own may free the cycle before the freeze does
    try:
        garbage = _Node()
        garbage.me = garbage
        freed = weakref.ref(garbage)
        del garbage
        kept = _Node()
        kept.me = kept
        before = gc.get_freeze_count()
        assert freed() is not None, "the cycle was collected before the test could look"
        with frozen_startup_heap():
            assert freed() is None, "a garbage cycle was frozen instead of freed"
            assert gc.get_freeze_count() > before and kept.me is kept
        assert gc.get_freeze_count() == 0, "the heap stayed frozen after serving"
    finally:
        if enabled:
            gc.enable()
