"""The HTTP server prepares a long request (chat template, tokenization) on a worker thread,
where it cannot stall every open stream, and a short one on the event loop, where it saves
two interpreter-lock handoffs. In process, through httpx's ASGI transport, with the engine
thread started as the app's lifespan does."""

from __future__ import annotations

import asyncio
import threading

import httpx
import msgspec

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving import http_server
from graphrelay.capture.serving.engine_worker import EngineWorker
from graphrelay.capture.serving.http_server import OpenAIServer, ServerOptions
from graphrelay.capture.serving.loop import ServingLoop

LONG = "word " * (http_server.INLINE_PREPARE_CHARS // 5 + 1)  # past the inline limit, ~200 tokens


def test_long_requests_are_prepared_off_the_event_loop_and_short_ones_on_it(codec, monkeypatch):
    config = msgspec.structs.replace(ModelConfig.preset("tiny"), vocab_size=len(codec.tokenizer), max_seq_len=256)
    engine = Engine(EngineConfig(config, max_reqs=2, max_batch=2, device="cpu", use_graphs=False))
    server = OpenAIServer(EngineWorker(ServingLoop(engine, "overlap"), 1024), codec, ServerOptions(model_name="tiny"))
    threads = []

    def recording(prepare):
        def prepare_recorded(*args):
            threads.append(threading.current_thread())
            return prepare(*args)
        return prepare_recorded

    monkeypatch.setattr(http_server, "prepare_completion", recording(http_server.prepare_completion))
    monkeypatch.setattr(http_server, "prepare_chat", recording(http_server.prepare_chat))

    async def ask() -> tuple[threading.Thread, list[int]]:
        server.worker.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as client:
                statuses = []
                for text in ("Hello there", LONG):
                    completion = await client.post("/v1/completions", json={"model": "tiny", "prompt": text,
                                                                          "max_tokens": 3})
                    chat = await client.post("/v1/chat/completions", json={
                        "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3})
                    statuses += [completion.status_code, chat.status_code]
            return threading.current_thread(), statuses
        finally:
            await server.worker.stop()

    loop_thread, statuses = asyncio.run(ask())
    assert statuses == [200] * 4
    assert len(threads) == 4
    assert threads[0] is threads[1] is loop_thread, threads  # short: on the event loop
    assert all(t is not loop_thread for t in threads[2:]), threads  # long: on a worker thread
