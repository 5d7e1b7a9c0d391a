"""The HTTP server prepares a request (chat template, tokenization, grammar compile) on a
worker thread: on the event loop a long prompt would stall every open stream. In process,
through httpx's ASGI transport, with the engine thread started as the app's lifespan does."""

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


def test_completion_and_chat_requests_are_prepared_off_the_event_loop(codec, monkeypatch):
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
                completion = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there",
                                                                      "max_tokens": 3})
                chat = await client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
            return threading.current_thread(), [completion.status_code, chat.status_code]
        finally:
            await server.worker.stop()

    loop_thread, statuses = asyncio.run(ask())
    assert statuses == [200, 200]
    assert len(threads) == 2 and all(t is not loop_thread for t in threads), threads
