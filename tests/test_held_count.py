"""The count of requests a server holds against its bound: one process's, and the one every
API server process of a port shares (taken in one process, seen and given back in another)."""

from __future__ import annotations

import multiprocessing

import pytest

from graphrelay.capture.serving.engine_handle import HeldCount, SharedHeldCount


def _take_twice_then_give_once(held: SharedHeldCount, bound: int, results) -> None:
    results.put((held.take(bound), held.take(bound)))
    held.give()


@pytest.mark.parametrize("shared", [False, True], ids=["one-process", "shared"])
def test_take_stops_at_the_bound_and_give_makes_room(shared):
    held = SharedHeldCount(multiprocessing.get_context("spawn")) if shared else HeldCount()
    assert [held.take(3) for _ in range(4)] == [True, True, True, False]
    assert held.value == 3
    held.give()
    assert held.take(3) and not held.take(3) and held.value == 3


def test_another_process_takes_from_the_same_count():
    """A spawned process (as an API server is) inherits the count: what it takes, the first
    process sees, and the bound holds across both."""
    context = multiprocessing.get_context("spawn")
    held, results = SharedHeldCount(context), context.Queue()
    assert held.take(3)
    child = context.Process(target=_take_twice_then_give_once, args=(held, 3, results))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert results.get(timeout=10) == (True, True)  # 1 + 2 = the bound of 3
    assert held.value == 2 and held.take(3) and not held.take(3)
