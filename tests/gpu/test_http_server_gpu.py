"""The real model served over HTTP on the GPU (CUDA graphs, overlap): a request's greedy text
equals the in-process loop's for the same request, and a burst of concurrent streams with
some clients disconnecting mid-stream completes with no slot left behind.

Needs the `serve` and `test` extras on the GPU machine (wheels: see the README's server part).
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from http_cases import start_server, stop_server, wait_until_idle

pytestmark = pytest.mark.gpu

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.")
NEW_TOKENS = 24
SLOTS = 16


@pytest.fixture(scope="module")
def kernel_plan(tmp_path_factory):
    """The server measures its projection kernels into this file; the in-process engine reads
    them back: two processes measuring on their own may each keep another of two tilings that
    tie, and the bf16 text then differs where a near-tie flips (seen on the H200)."""
    return tmp_path_factory.mktemp("plan") / "kernel_plan.json"


@pytest.fixture(scope="module")
def server(kernel_plan):
    process = start_server(["--device", "cuda", "--max-reqs", str(SLOTS), "--max-batch", str(SLOTS),
                            "--max-seq-len", "512", "--max-waiting", "64", "--kernel-plan", str(kernel_plan)],
                           timeout_s=600)
    yield process
    stop_server(process)


def test_http_text_equals_the_in_process_loop(server, kernel_plan):
    from graphrelay.capture.iteration.engine import Engine, EngineConfig
    from graphrelay.capture.model.model_source import load_model
    from graphrelay.capture.serving.loop import ServingLoop
    from graphrelay.capture.serving.workloads import Request

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    # One request at a time on both sides: the same bucket, so bf16 rounds the same way.
    over_http = [client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": q}],
                                                max_tokens=NEW_TOKENS, temperature=0).choices[0].message.content
                 for q in QUESTIONS]
    loaded = load_model("smollm2-135m", dtype="bfloat16", max_seq_len=512)
    engine = Engine(EngineConfig(loaded.config, max_reqs=SLOTS, max_batch=SLOTS, device="cuda"), weights=loaded.weights)
    engine.capture(plan_file=kernel_plan)
    loop = ServingLoop(engine, "overlap")
    for question, text in zip(QUESTIONS, over_http):
        prompt = loaded.codec.encode_chat([{"role": "user", "content": question}])
        out = loop.run([Request("q", prompt, NEW_TOKENS, stop_tokens=loaded.codec.stop_tokens)]).outputs["q"]
        assert loaded.codec.decode(out.tokens) == text, question


def test_concurrent_streams_with_disconnects_leave_no_slot_behind(server):
    async def one(client, i: int):
        stream = await client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            max_tokens=64, temperature=0.7, seed=i, stream=True)
        reasons, chunks = [], 0
        async for chunk in stream:
            chunks += 1
            if i % 10 == 0 and chunks == 4:
                await stream.close()  # every tenth client goes away mid-stream
                return None
            # (a tenth client whose sampled answer ends within 3 chunks finishes instead)
            if chunk.choices and chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
        return reasons

    async def burst():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(burst())
    gone = [i for i, r in enumerate(results) if r is None]
    assert gone and all(i % 10 == 0 for i in gone)  # only tenth clients leave, and some did
    assert all(r in (["stop"], ["length"]) for r in results if r is not None)
    wait_until_idle(server)
