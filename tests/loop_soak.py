"""A seeded soak of the serving loop: rounds of requests arrive, are aborted and finish while
slots churn through a small pool, with speculation on and off and greedy and sampled rows
mixed; every output is checked against a no-overlap reference run of the same requests.

Arrivals and aborts are scripted in loop turns (the `ScriptedInbox` releases them as the loop
drains it), not in seconds, so a seed gives the same schedule on a CPU and a GPU. What must
hold whatever the schedule: a finished request's tokens equal the reference's, an aborted
one's are a prefix of them, the tokens streamed to the sink are exactly the output's, and
every request finishes exactly once.
"""

from __future__ import annotations

import random
from typing import Optional

import msgspec

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.inbox import Inbox
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import Request

MODEL = ModelConfig.preset("tiny")
# One token bucket for every engine: each row is computed at the same shape in the reference
# and the soak, so tokens agree bit for bit whatever else shares the iteration.
MAX_TOKENS, MAX_BATCH, MAX_REQS = 24, 4, 5
SPEC = SpecConfig(k=3, min_n=1, max_n=3)
REQUESTS_PER_ROUND = 24


def make_engine(device: str, spec: Optional[SpecConfig]) -> Engine:
    engine = Engine(EngineConfig(MODEL, max_reqs=MAX_REQS, max_batch=MAX_BATCH, device=device, max_tokens=MAX_TOKENS,
                                 buckets=(MAX_TOKENS,), use_graphs=device != "cpu", spec=spec, debug=True))
    engine.capture()
    return engine


def round_requests(rng: random.Random, round_index: int) -> list[Request]:
    """Prompts up to 40 tokens (chunked over iterations: the budget is 24), some repeating a
    pattern (so n-gram drafts get accepted), half sampled; no stop tokens yet (`add_stops`)."""
    requests = []
    for i in range(REQUESTS_PER_ROUND):
        length = rng.randint(1, 40)
        if rng.random() < 0.4:
            pattern = [rng.randrange(MODEL.vocab_size) for _ in range(rng.randint(1, 4))]
            prompt = (pattern * length)[:length]
        else:
            prompt = [rng.randrange(MODEL.vocab_size) for _ in range(length)]
        sampling = SamplingParams()
        if rng.random() < 0.5:
            sampling = SamplingParams(temperature=rng.choice((0.7, 1.0, 1.5)), top_k=rng.choice((0, 5, 40)),
                                      top_p=rng.choice((1.0, 0.9)), seed=rng.randrange(2**40))
        requests.append(Request(id=f"s{round_index}-{i}", prompt=prompt, max_new_tokens=rng.randint(1, 48),
                                sampling=sampling))
    return requests


def add_stops(rng: random.Random, requests: list[Request], reference: dict[str, list[int]]):
    """Give 40% of the requests a stop token their reference output does produce, and cut
    the expected tokens after its first occurrence: stops the scheduler cannot foresee, so a
    finished request often has its next iteration already in flight."""
    requests, expected = list(requests), dict(reference)
    for i, r in enumerate(requests):
        tokens = reference[r.id]
        if len(tokens) > 1 and rng.random() < 0.4:
            stop = tokens[rng.randrange(len(tokens))]
            requests[i] = msgspec.structs.replace(r, stop_tokens=(stop,))
            expected[r.id] = tokens[: tokens.index(stop) + 1]
    return requests, expected


class ScriptedInbox(Inbox):
    """Submits each request at its loop turn and aborts at theirs; closes after the last."""

    def __init__(self, arrivals: list[tuple[int, Request]], aborts: list[tuple[int, str]]):
        super().__init__()
        self._arrivals, self._abort_at = sorted(arrivals, key=lambda a: a[0]), sorted(aborts)
        self.turn = 0

    def drain(self):
        while self._arrivals and self._arrivals[0][0] <= self.turn:
            self.submit(self._arrivals.pop(0)[1])
        while self._abort_at and self._abort_at[0][0] <= self.turn:
            self.abort(self._abort_at.pop(0)[1])
        if not self._arrivals and not self._abort_at:
            self.close()
        self.turn += 1
        return super().drain()

    def wait(self, timeout: float) -> None:
        pass  # idle turns advance the script at once: nothing else would


class CheckingSink:
    """Keeps each request's streamed tokens and its one finished output."""

    def __init__(self) -> None:
        self.streamed: dict[str, list[int]] = {}
        self.outputs: dict = {}
        self.finished_twice: list[str] = []

    def on_tokens(self, request_id: str, tokens: list[int], logprobs=None) -> None:
        self.streamed.setdefault(request_id, []).extend(tokens)

    def on_finish(self, output) -> None:
        if output.id in self.outputs:
            self.finished_twice.append(output.id)
        self.outputs[output.id] = output


def check_round(requests: list[Request], reference: dict[str, list[int]], sink: CheckingSink) -> list[str]:
    """Every way the soak's outputs may disagree with the reference, one line each."""
    problems = [f"{rid}: finished twice" for rid in sink.finished_twice]
    for r in requests:
        out = sink.outputs.get(r.id)
        if out is None:
            problems.append(f"{r.id}: never finished")
            continue
        want = reference[r.id]
        if sink.streamed.get(r.id, []) != out.tokens:
            problems.append(f"{r.id}: streamed {sink.streamed.get(r.id, [])} but finished with {out.tokens}")
        if out.finish_reason == "abort":
            if out.tokens != want[: len(out.tokens)]:
                problems.append(f"{r.id}: aborted with {out.tokens}, not a prefix of the reference {want}")
        elif out.tokens != want:
            problems.append(f"{r.id}: {out.finish_reason} with {out.tokens}, the reference made {want}")
    return problems


def soak(device: str, iterations: int, seed: int = 0) -> dict:
    """Run rounds until the soak's loops have launched `iterations` iterations; returns the
    totals and every problem found (none expected)."""
    rng = random.Random(seed)
    plain, speculative = make_engine(device, None), make_engine(device, SPEC)
    totals = dict(rounds=0, iterations=0, requests=0, aborted=0, tokens=0, host_syncs=0, spec_tokens_per_step=0.0,
                  problems=[])
    while totals["iterations"] < iterations:
        requests = round_requests(rng, totals["rounds"])
        reference = {rid: out.tokens for rid, out in ServingLoop(plain, "no-overlap").run(requests).outputs.items()}
        requests, reference = add_stops(rng, requests, reference)
        engine = speculative if totals["rounds"] % 2 else plain
        # Churn: a burst at turn 0, then arrivals spread over the round; a quarter aborted a
        # few turns after they arrive (before admission, mid-prompt or mid-decode).
        arrivals = [(0 if i < MAX_REQS else rng.randint(0, 6 * REQUESTS_PER_ROUND), r) for i, r in enumerate(requests)]
        aborts = [(turn + rng.randint(0, 30), r.id) for turn, r in arrivals if rng.random() < 0.25]
        sink = CheckingSink()
        stats = ServingLoop(engine, "overlap").serve(ScriptedInbox(arrivals, aborts), sink)
        engine.relay.check()  # debug mode: no row read before it was written, none read twice
        totals["problems"] += check_round(requests, reference, sink)
        totals["rounds"] += 1
        totals["iterations"] += stats.iterations
        totals["requests"] += len(requests)
        totals["aborted"] += sum(o.finish_reason == "abort" for o in sink.outputs.values())
        totals["tokens"] += sum(len(o.tokens) for o in sink.outputs.values())
        totals["host_syncs"] += stats.host_syncs
        if engine is speculative:
            totals["spec_tokens_per_step"] = max(totals["spec_tokens_per_step"], stats.tokens_per_request_step)
    return totals
