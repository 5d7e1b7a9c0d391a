"""A stream the event loop fell behind on catches up in one piece: every event queued for a
request when its handler wakes becomes one text piece (one server-sent event), whose text and
logprobs are those of the tokens one by one; a finish or a stop string inside the backlog ends
the answer there. Driven without a server: the handler's generator on a stub engine handle."""

from __future__ import annotations

import asyncio
import time

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.engine_handle import EngineHandle, EngineInfo, NewTokens
from graphrelay.capture.serving.http_server import Completion, OpenAIServer, ServerOptions
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.openai_api import Prepared
from graphrelay.capture.serving.workloads import Request

TEXT = "The capital of France is Paris, and the capital of Italy is Rome."


class _Handle(EngineHandle):
    def __init__(self):
        super().__init__(EngineInfo(ModelConfig.preset("tiny"), 2, 8, True, "cpu"), 0)
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _pieces(codec, events, *, stop=(), logprobs=False):
    """The pieces `_generate` yields when every event is already queued before it runs."""
    server = OpenAIServer(_Handle(), codec, ServerOptions())
    controls = ControlParams(logprobs=0) if logprobs else None
    prepared = Prepared(Request("r", [1], 64, controls=controls, stop=tuple(stop)), True, False, int(time.time()))

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for event in events:
            queue.put_nowait(event)
        return [p async for p in server._generate(prepared, queue, Completion(prepared))]

    return asyncio.run(run()), server.worker.aborted


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(-0.5 - token / 1e5, [(token, -0.5)])


def test_a_backlog_of_token_batches_is_one_piece(codec):
    tokens = codec.encode(TEXT)
    batches = [NewTokens(tokens[i:i + 2], [_lp(t) for t in tokens[i:i + 2]]) for i in range(0, len(tokens), 2)]
    pieces, aborted = _pieces(codec, batches + [RequestOutput("r", tokens, "length")], logprobs=True)
    assert len(pieces) == 1, [p.text for p in pieces]
    assert pieces[0].text == codec.decode(tokens) == TEXT
    assert [e.token for e in pieces[0].logprobs] == tokens
    assert [e.logprobs for e in pieces[0].logprobs] == [_lp(t) for t in tokens]
    assert aborted == []


def test_a_stop_string_inside_the_backlog_ends_the_answer_and_aborts(codec):
    tokens = codec.encode(TEXT)
    batches = [NewTokens([t], None) for t in tokens]
    pieces, aborted = _pieces(codec, batches, stop=[", and"])
    assert len(pieces) == 1
    assert pieces[0].text == "The capital of France is Paris"
    assert aborted == ["r"]  # the tokens still in flight are not wanted


def test_events_arriving_apart_stay_apart(codec):
    """Nothing is held back waiting for more: each wake-up sends what has come so far."""
    server = OpenAIServer(_Handle(), codec, ServerOptions())
    prepared = Prepared(Request("r", [1], 64), True, False, int(time.time()))
    tokens = codec.encode(TEXT)

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        pieces = server._generate(prepared, queue, Completion(prepared))
        got = []
        for i, token in enumerate(tokens):
            queue.put_nowait(NewTokens([token], None))
            if i == len(tokens) - 1:
                queue.put_nowait(RequestOutput("r", tokens, "length"))
            got.append((await anext(pieces)).text)
        return got

    got = asyncio.run(run())
    assert len(got) == len(tokens)
    assert "".join(got) == TEXT
