"""The engine process's inbox and sink (`capture.serving.engine_channel`), on the loop's
thread: requests and aborts come through in order, a turn's results leave as one frame (and
before the loop sleeps), refused controls are answered without reaching the loop, a grammar
compiles off the loop's thread without holding up the requests behind it, and an end of the
pipe reads as a closed inbox only once nothing is left compiling."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest

from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.serving import engine_channel
from graphrelay.capture.serving import engine_messages as em
from graphrelay.capture.serving.engine_channel import EngineChannel
from graphrelay.capture.serving.frames import FrameReader, FrameWriter
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.workloads import Request

HANG_S = 60  # only bounds a hang
OCCUPANCY = {"slots": 4, "free_slots": 4, "running": 0, "retiring": 0, "waiting": 0}


class FakeControls:
    """Refuses logit_bias on token 999; a grammar's check waits for `compiled`."""

    def __init__(self):
        self.compiled = threading.Event()
        self.threads: list[str] = []

    def check(self, params, stop_tokens):
        self.threads.append(threading.current_thread().name)
        if params.grammar is not None:
            assert self.compiled.wait(HANG_S)
        if 999 in params.logit_bias:
            raise ValueError("logit_bias: token 999 is refused here")


class Link:
    """One API server's ends of its two pipes, as the HTTP side holds them."""

    def __init__(self):
        self.requests_read, self.requests_write = os.pipe()
        self.results_read, self.results_write = os.pipe()
        self.to_engine = FrameWriter(self.requests_write)
        self.from_engine = FrameReader(self.results_read)

    def send(self, *messages) -> None:
        for message in messages:
            self.to_engine.send(em.encode(message))

    def results(self) -> list[em.Results]:
        return [em.decode_to_server(f) for f in self.from_engine.read()]

    def hang_up(self) -> None:
        """The server process is gone: both of its ends close."""
        for name in ("requests_write", "results_read"):
            os.close(getattr(self, name))
            setattr(self, name, None)


class Ends:
    """A channel over fresh pipes for `servers` API servers; the first server's methods."""

    def __init__(self, monkeypatch, heartbeat_s: float = 3600.0, servers: int = 1):
        monkeypatch.setattr(engine_channel, "HEARTBEAT_S", heartbeat_s)
        self.links = [Link() for _ in range(servers)]
        self.controls = FakeControls()
        loop = SimpleNamespace(engine=SimpleNamespace(controls=self.controls), occupancy=lambda: dict(OCCUPANCY))
        self.channel = EngineChannel([(link.requests_read, link.results_write) for link in self.links], loop)
        self.send, self.results = self.links[0].send, self.links[0].results

    @property
    def requests_write(self):
        return self.links[0].requests_write

    def close(self) -> None:
        self.channel.close()
        for link in self.links:
            for fd in vars(link).values():
                if isinstance(fd, int):
                    os.close(fd)


@pytest.fixture
def ends(monkeypatch):
    made = Ends(monkeypatch)
    yield made
    made.close()


def _request(rid: str, **controls) -> Request:
    return Request(id=rid, prompt=[1, 2], max_new_tokens=3, controls=ControlParams(**controls) if controls else None)


def test_submissions_and_aborts_reach_the_loop_in_order_and_admissions_go_back_in_one_frame(ends):
    ends.send(em.Submit(_request("a")), em.Submit(_request("b", logit_bias={5: 1.0})), em.Abort("a"))
    drained = ends.channel.drain()
    assert [r.id for r in drained.requests] == ["a", "b"] and drained.aborts == ["a"] and not drained.closed
    sent = ends.results()
    assert len(sent) == 1 and sent[0].admitted == ["a", "b"] and sent[0].rejected == [] and sent[0].events == []
    assert sent[0].occupancy == OCCUPANCY
    again = ends.channel.drain()
    assert again.requests == [] and again.aborts == [] and ends.results() == []  # an idle turn sends nothing


def test_refused_controls_are_answered_and_never_reach_the_loop(ends):
    ends.send(em.Submit(_request("bad", logit_bias={999: 1.0})), em.Submit(_request("ok")))
    drained = ends.channel.drain()
    assert [r.id for r in drained.requests] == ["ok"]
    (sent,) = ends.results()
    assert sent.admitted == ["ok"] and [r.request_id for r in sent.rejected] == ["bad"]
    assert sent.rejected[0].message.startswith("logit_bias")


def test_a_turns_results_leave_as_one_frame_in_order_and_before_the_loop_sleeps(ends):
    output = RequestOutput("a", [4, 5], "length", token_times_ms=[1.0, 2.0])
    ends.send(em.Submit(_request("a")), em.Submit(_request("b")))
    ends.channel.drain()
    ends.results()
    ends.channel.on_tokens("a", [4], None)
    ends.channel.on_tokens("b", [7], None)
    ends.channel.on_tokens("a", [5], None)
    ends.channel.on_finish(output)
    assert ends.results() == []  # nothing leaves mid-turn
    ends.channel.wait(0.0)  # the loop idles: what it gathered must not wait out the sleep
    (sent,) = ends.results()
    assert [(e.request_id, e.tokens) for e in sent.events[:3]] == [("a", [4]), ("b", [7]), ("a", [5])]
    assert sent.events[3].output.tokens == [4, 5] and sent.events[3].output.token_times_ms == []


def test_an_idle_channel_sends_its_slot_counts_every_heartbeat(monkeypatch):
    ends = Ends(monkeypatch, heartbeat_s=0.0)
    try:
        ends.channel.drain()
        ends.channel.drain()
        sent = ends.results()
        assert len(sent) == 2 and all(s.events == [] and s.occupancy == OCCUPANCY for s in sent)
        assert all(s.rss_bytes is None or s.rss_bytes > 0 for s in sent)
    finally:
        ends.close()


def test_a_grammar_compiles_off_the_loops_thread_and_the_requests_behind_it_go_first(ends):
    ends.send(em.Submit(_request("g", regex="a+")), em.Submit(_request("plain", logit_bias={5: 1.0})))
    first = ends.channel.drain()
    assert [r.id for r in first.requests] == ["plain"]
    ends.controls.compiled.set()
    started = time.monotonic()
    ends.channel.wait(HANG_S)  # a finished compile wakes an idle loop
    assert time.monotonic() - started < HANG_S, "the finished compile did not wake the idle wait"
    assert [r.id for r in ends.channel.drain().requests] == ["g"]
    admitted = [rid for sent in ends.results() for rid in sent.admitted]
    assert admitted == ["plain", "g"]
    loop_thread = threading.current_thread().name
    assert ends.controls.threads[0] != loop_thread and ends.controls.threads[1] == loop_thread


def test_an_abort_while_the_grammar_compiles_follows_its_admission(ends):
    ends.send(em.Submit(_request("g", regex="a+")), em.Abort("g"))
    assert ends.channel.drain().aborts == []  # the loop does not know "g" yet: the abort would be lost
    ends.controls.compiled.set()
    ends.channel.wait(HANG_S)
    drained = ends.channel.drain()
    assert [r.id for r in drained.requests] == ["g"] and drained.aborts == ["g"]


def test_the_pipe_closing_closes_the_inbox_once_no_grammar_is_compiling(ends):
    ends.send(em.Submit(_request("g", regex="a+")))
    os.close(ends.links[0].requests_write)
    ends.links[0].requests_write = None
    assert not ends.channel.drain().closed  # "g" still compiles: the loop must not return yet
    ends.controls.compiled.set()
    deadline = time.monotonic() + HANG_S
    while True:  # the pipe's end wakes the wait too, maybe before the compile is done
        ends.channel.wait(HANG_S)
        drained = ends.channel.drain()
        if drained.requests or time.monotonic() > deadline:
            break
        assert not drained.closed
    assert [r.id for r in drained.requests] == ["g"] and drained.closed


def test_close_closes_the_inbox_and_aborts_still_come_through(ends):
    ends.send(em.Close(), em.Abort("x"))
    drained = ends.channel.drain()
    assert drained.closed and drained.aborts == ["x"]


def test_each_servers_results_go_to_it_alone_and_the_inbox_closes_when_all_have(monkeypatch):
    ends = Ends(monkeypatch, servers=2)
    first, second = ends.links
    try:
        first.send(em.Submit(_request("a")))
        second.send(em.Submit(_request("b")))
        assert [r.id for r in ends.channel.drain().requests] == ["a", "b"]
        ends.channel.on_tokens("b", [7], None)
        ends.channel.on_tokens("a", [4], None)
        ends.channel.on_finish(RequestOutput("b", [7], "length"))
        ends.channel.drain()
        got_first = [e for sent in first.results() for e in sent.events]
        got_second = [e for sent in second.results() for e in sent.events]
        assert [e.request_id for e in got_first] == ["a"]
        assert [getattr(e, "request_id", None) or e.output.id for e in got_second] == ["b", "b"]
        first.send(em.Close())
        assert not ends.channel.drain().closed  # the second still serves
        second.send(em.Close())
        assert ends.channel.drain().closed
    finally:
        ends.close()


def test_a_server_that_goes_has_its_requests_aborted_and_the_others_carry_on(monkeypatch):
    ends = Ends(monkeypatch, servers=2)
    first, second = ends.links
    try:
        first.send(em.Submit(_request("a")))
        second.send(em.Submit(_request("b")), em.Submit(_request("c")))
        ends.channel.drain()
        second.hang_up()
        ends.channel.on_tokens("b", [1], None)
        ends.channel.on_tokens("a", [2], None)
        drained = ends.channel.drain()  # the write to the second server breaks: its requests are aborted
        assert sorted(drained.aborts) == ["b", "c"] and not drained.closed
        assert [e.request_id for sent in first.results() for e in sent.events] == ["a"]
        ends.channel.on_finish(RequestOutput("b", [1], "abort"))  # nothing goes to a server that is gone
        ends.channel.drain()
        first.send(em.Close())
        assert ends.channel.drain().closed
    finally:
        ends.close()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads resident memory from /proc (Linux)")
def test_the_heartbeat_measures_every_api_server_that_said_hello(monkeypatch):
    from graphrelay.capture.serving.engine_handle import resident_bytes
    ends = Ends(monkeypatch, heartbeat_s=0.0)
    try:
        ends.channel.drain()
        (alone,) = ends.results()
        ends.send(em.Hello(os.getpid()))  # the "server" is this process: counted a second time
        ends.channel.drain()
        (both,) = ends.results()
        assert alone.rss_bytes < 1.5 * resident_bytes() < both.rss_bytes
    finally:
        ends.close()
