"""The HTTP server's engine thread handle, against a scripted stand-in for the loop: results
reach each request's queue in order, admission is bounded and frees up as requests finish,
and a failing engine fails every waiting request and every later one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.engine_handle import EngineStopped, Overloaded
from graphrelay.capture.serving.engine_worker import EngineWorker
from graphrelay.capture.serving.inbox import Inbox
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.workloads import Request

HANG_S = 60


class ScriptedLoop:
    """Runs `script(inbox, sink)` as its serve; two slots."""

    def __init__(self, script, device: str = "cpu"):
        self.engine = SimpleNamespace(max_reqs=2, device=torch.device(device), on_gpu=device.startswith("cuda"),
                                      model=SimpleNamespace(config=ModelConfig()), config=SimpleNamespace(max_top_k=0),
                                      controls=None)
        self.script = script

    def serve(self, inbox: Inbox, sink):
        return self.script(inbox, sink)

    def occupancy(self) -> dict:
        return {}


def _next_requests(inbox: Inbox) -> list[Request]:
    while True:
        drained = inbox.drain()
        if drained.requests or drained.closed:
            return drained.requests
        inbox.wait(0.01)


def _request(i: int) -> Request:
    return Request(id=f"r{i}", prompt=[1], max_new_tokens=4)


async def _events(queue: asyncio.Queue) -> list:
    out = []
    while not out or not isinstance(out[-1], (RequestOutput, BaseException)):
        out.append(await asyncio.wait_for(queue.get(), HANG_S))
    return out


def test_results_reach_each_request_in_order():
    def script(inbox, sink):
        requests = []
        while len(requests) < 2:
            requests += _next_requests(inbox)
        for step in range(3):
            for r in requests:
                sink.on_tokens(r.id, [step, step + 10])
        for r in requests:
            sink.on_finish(RequestOutput(r.id, [], "length"))
        _next_requests(inbox)  # until closed

    async def main():
        worker = EngineWorker(ScriptedLoop(script), max_waiting=0)
        worker.start()
        queues = [worker.submit(_request(i)) for i in range(2)]
        got = [await _events(q) for q in queues]
        await worker.stop()
        return got, worker.health()

    got, health = asyncio.run(main())
    for events in got:
        assert [e.tokens for e in events[:-1]] == [[0, 10], [1, 11], [2, 12]] and events[-1].finish_reason == "length"
    assert health["engine"] == "stopped" and health["outstanding"] == 0 and health["finished"] == {"length": 2}


def test_admission_is_bounded_and_frees_up_as_requests_finish():
    def script(inbox, sink):
        while True:
            drained = inbox.drain()
            for rid in drained.aborts:  # finish what the test aborts, nothing else
                sink.on_finish(RequestOutput(rid, [], "abort"))
            if drained.closed:
                return
            inbox.wait(0.01)

    async def main():
        worker = EngineWorker(ScriptedLoop(script), max_waiting=1)
        worker.start()
        queues = [worker.submit(_request(i)) for i in range(3)]  # two slots, one waiting place
        with pytest.raises(Overloaded):
            worker.submit(_request(3))
        worker.abort("r0")
        assert (await _events(queues[0]))[-1].finish_reason == "abort"
        worker.submit(_request(4))  # room again
        for rid in ("r1", "r2", "r4"):
            worker.abort(rid)
        await worker.stop()
        return worker.health()

    assert asyncio.run(main())["outstanding"] == 0


def test_a_failing_engine_fails_waiting_and_later_requests():
    def script(inbox, sink):
        _next_requests(inbox)
        raise RuntimeError("device lost")

    async def main():
        worker = EngineWorker(ScriptedLoop(script), max_waiting=4)
        worker.start()
        events = await _events(worker.submit(_request(0)))
        await asyncio.to_thread(worker._thread.join, HANG_S)
        with pytest.raises(EngineStopped, match="device lost"):
            worker.submit(_request(1))
        return events, worker.health()

    events, health = asyncio.run(main())
    assert isinstance(events[-1], RuntimeError) and health["engine"] == "failed"


def test_a_failing_engine_calls_on_failure_once_from_its_thread():
    """The server hangs its shutdown on this: a dead engine must not leave the server listening."""
    calls = []

    def script(inbox, sink):
        raise RuntimeError("capture failed")

    async def main():
        worker = EngineWorker(ScriptedLoop(script), max_waiting=0)
        worker.on_failure = lambda: calls.append(isinstance(worker.failure, RuntimeError))
        worker.start()
        await asyncio.to_thread(worker._thread.join, HANG_S)
        return worker.health()

    assert asyncio.run(main())["engine"] == "failed" and calls == [True]


@pytest.mark.parametrize("device, bound", [("cuda", 3), ("cuda:1", 1)])
def test_the_engine_thread_runs_on_the_engines_cuda_device(device, bound, monkeypatch):
    """A new thread starts on device 0: "cuda" (no index) is the device current where the worker
    was built, and torch.cuda.set_device refuses a device without an index."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Fake GPU")  # for /health
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen.append(index))

    def script(inbox, sink):
        _next_requests(inbox)  # until closed

    async def main():
        worker = EngineWorker(ScriptedLoop(script, device), max_waiting=0)
        worker.start()
        await worker.stop()
        return worker.health()

    health = asyncio.run(main())
    assert health["engine"] == "stopped" and health["device"] == "Fake GPU" and seen == [bound]
