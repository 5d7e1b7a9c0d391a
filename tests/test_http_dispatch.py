"""The ASGI app's two roads: a completion POST goes straight to its handler (no Starlette
middleware around each streamed chunk), everything else through Starlette. Both give OpenAI's
error shape: an unexpected failure inside a completion handler is a 500 JSON answer, another
method on a completion path a 405, an unknown path a 404. In process, through httpx's ASGI
transport, with the engine thread started as the app's lifespan does."""

from __future__ import annotations

import asyncio

import httpx
import msgspec

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving import http_server
from graphrelay.capture.serving.engine_worker import EngineWorker
from graphrelay.capture.serving.http_server import OpenAIServer, ServerOptions
from graphrelay.capture.serving.loop import ServingLoop


def test_direct_and_starlette_roads_answer_in_openai_shape(codec, monkeypatch):
    config = msgspec.structs.replace(ModelConfig.preset("tiny"), vocab_size=len(codec.tokenizer), max_seq_len=256)
    engine = Engine(EngineConfig(config, max_reqs=2, max_batch=2, device="cpu", use_graphs=False))
    server = OpenAIServer(EngineWorker(ServingLoop(engine, "overlap"), 1024), codec, ServerOptions(model_name="tiny"))

    def broken_prepare(*args):
        raise RuntimeError("tokenizer fell over")

    async def ask() -> list[httpx.Response]:
        server.worker.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://t") as client:
                ok = await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2,
                                                                "stream": True})
                with monkeypatch.context() as patch:
                    patch.setattr(http_server, "prepare_chat", broken_prepare)
                    failed = await client.post("/v1/chat/completions", json={
                        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                wrong_method = await client.get("/v1/completions")
                unknown = await client.post("/v1/nothing", json={})
                models = await client.get("/v1/models")
                return [ok, failed, wrong_method, unknown, models]
        finally:
            await server.worker.stop()

    ok, failed, wrong_method, unknown, models = asyncio.run(ask())
    assert ok.status_code == 200 and ok.text.endswith("data: [DONE]\n\n")
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error" and "tokenizer fell over" in failed.json()["error"]["message"]
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
