"""The serving loop's continuous driver: requests submitted from another thread while it runs
get the same tokens as a batch run, the sink hears every token before the finish, an abort
through the inbox frees the slot, and the loop idles on an open inbox and returns once it is
closed and drained."""

from __future__ import annotations

import threading
import time

import pytest

from graphrelay.capture.serving.inbox import Inbox, InboxClosed
from graphrelay.capture.serving.loop import ServingLoop
from test_loop import make_engine, tokens_of, workload

HANG_S = 300  # only bounds a hang


class RecordingSink:
    def __init__(self):
        self.events: list[tuple[str, str, object]] = []
        self.done = threading.Event()
        self.finished: dict[str, object] = {}

    def on_tokens(self, request_id, tokens, logprobs=None):
        self.events.append(("tokens", request_id, list(tokens)))

    def on_finish(self, output):
        self.events.append(("finish", output.id, output))
        self.finished[output.id] = output


def _serve_in_thread(loop: ServingLoop, inbox: Inbox, sink) -> threading.Thread:
    thread = threading.Thread(target=loop.serve, args=(inbox, sink), daemon=True)
    thread.start()
    return thread


def test_requests_submitted_while_running_match_a_batch_run():
    requests = workload(num_requests=6, output_len=(2, 10))
    batch = tokens_of(ServingLoop(make_engine("overlap", "cpu"), "overlap").run(requests))
    loop = ServingLoop(make_engine("overlap", "cpu"), "overlap")
    inbox, sink = Inbox(), RecordingSink()
    thread = _serve_in_thread(loop, inbox, sink)
    for r in requests:
        inbox.submit(r)
        time.sleep(0.02)  # arrivals spread over the run, some while others decode
    inbox.close()
    thread.join(HANG_S)
    assert not thread.is_alive()
    assert {rid: out.tokens for rid, out in sink.finished.items()} == batch
    # Per request: token batches in order, concatenating to the output, then exactly one finish.
    for r in requests:
        mine = [e for e in sink.events if e[1] == r.id]
        assert [kind for kind, _, _ in mine] == ["tokens"] * (len(mine) - 1) + ["finish"]
        assert sum((tokens for _, _, tokens in mine[:-1]), []) == mine[-1][2].tokens
    assert loop.occupancy()["free_slots"] == loop.engine.max_reqs


def test_abort_through_the_inbox_frees_the_slot_and_spares_the_others():
    requests = workload(num_requests=3, output_len=(40, 40))
    loop = ServingLoop(make_engine("overlap", "cpu"), "overlap")
    inbox, sink = Inbox(), RecordingSink()
    thread = _serve_in_thread(loop, inbox, sink)
    for r in requests:
        inbox.submit(r)
    deadline = time.monotonic() + HANG_S
    while not any(kind == "tokens" and rid == "r1" for kind, rid, _ in list(sink.events)):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    inbox.abort("r1")
    inbox.abort("no-such-request")  # ignored
    inbox.close()
    thread.join(HANG_S)
    assert not thread.is_alive()
    assert sink.finished["r1"].finish_reason == "abort" and len(sink.finished["r1"].tokens) < 40
    assert [sink.finished[r].finish_reason for r in ("r0", "r2")] == ["length", "length"]
    assert loop.occupancy() == {"slots": 6, "free_slots": 6, "running": 0, "retiring": 0, "waiting": 0}


def test_an_open_inbox_idles_until_closed():
    loop = ServingLoop(make_engine("overlap", "cpu"), "overlap")
    inbox = Inbox()
    thread = _serve_in_thread(loop, inbox, RecordingSink())
    time.sleep(0.3)
    assert thread.is_alive(), "the loop returned while its inbox was open"
    inbox.close()
    thread.join(HANG_S)
    assert not thread.is_alive()
    with pytest.raises(InboxClosed, match="shutting down"):
        inbox.submit(workload(num_requests=1)[0])
