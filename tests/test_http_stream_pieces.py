"""A stream that falls behind the engine sends its backlog as one piece (one SSE event), and a
stream that keeps up sends a piece per token: the same text either way, one finishing piece."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.engine_worker import NewTokens
from graphrelay.capture.serving.http_server import Completion, OpenAIServer, ServerOptions
from graphrelay.capture.serving.loop import RequestOutput, ServingLoop
from graphrelay.capture.serving.openai_api import CompletionRequest, prepare_completion


@pytest.fixture(scope="module")
def server(codec):
    config = msgspec.structs.replace(ModelConfig.preset("tiny"), vocab_size=len(codec.tokenizer), max_seq_len=256)
    engine = Engine(EngineConfig(config, max_reqs=2, max_batch=2, device="cpu", use_graphs=False))
    return OpenAIServer(ServingLoop(engine, "overlap"), codec, ServerOptions(model_name="tiny"))


def pieces_of(server, tokens, *, backlog: bool, stop=None):
    """The pieces `_generate` yields for `tokens` (one NewTokens each, then the end), queued all
    before the stream reads (backlog) or one per read."""
    body = msgspec.convert({"model": "tiny", "prompt": "Hi", "max_tokens": 32, "stream": True,
                            **({"stop": stop} if stop else {})}, CompletionRequest)
    prepared = prepare_completion(body, server.codec, server.limits)
    events = [NewTokens([t], None) for t in tokens] + [RequestOutput(prepared.request.id, list(tokens), "length")]

    async def run():
        queue = asyncio.Queue()
        completion = Completion(prepared)
        got = []
        if backlog:
            for event in events:
                queue.put_nowait(event)
        else:
            queue.put_nowait(events[0])
        async for piece in server._generate(prepared, queue, completion):
            got.append(piece.text)
            if not backlog and len(got) < len(events):
                for event in events[len(got):len(got) + 1]:
                    queue.put_nowait(event)
        return got, completion

    return asyncio.run(run())


def test_a_backlog_goes_out_as_one_piece_and_a_live_stream_per_token(server, codec):
    tokens = codec.tokenizer.encode(" The capital of France is Paris.", add_special_tokens=False)
    assert len(tokens) >= 5
    text = codec.tokenizer.decode(tokens)
    behind, done_behind = pieces_of(server, tokens, backlog=True)
    live, done_live = pieces_of(server, tokens, backlog=False)
    assert behind == [text]  # the whole backlog in the finishing piece
    assert len(live) >= len(tokens) - 1 and "".join(live) == text
    assert done_behind.finish_reason == done_live.finish_reason == "length"
    assert done_behind.completion_tokens == done_live.completion_tokens == len(tokens)


def test_a_stop_string_inside_a_backlog_cuts_the_piece_and_finishes(server, codec):
    tokens = codec.tokenizer.encode(" The capital of France is Paris. It is big.", add_special_tokens=False)
    got, completion = pieces_of(server, tokens, backlog=True, stop=["Paris"])
    assert got == [" The capital of France is "] and completion.finish_reason == "stop"
