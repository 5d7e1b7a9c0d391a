"""What the controls tests share: a made-up text vocabulary for the tiny model, its EOS, a
JSON schema and a regex whose matches are short enough for a few dozen tokens, and a schedule
of iterations that switch between the engine's plain and controls step variants."""

from __future__ import annotations

import msgspec
import torch

from graphrelay.capture.iteration.controls.grammar import made_up_token_strings
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.engine import Engine
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.spans import decode_span, prefill_span
from graphrelay.capture.iteration.step import CONTROLS, PLAIN
from graphrelay.capture.model.model import ModelConfig

EOS = 0
STRINGS = made_up_token_strings(ModelConfig.preset("tiny").vocab_size)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"


def msgspec_replace(request, **changes):
    """A copy of a frozen request with `changes`."""
    return msgspec.structs.replace(request, **changes)


def always_controlled(engine: Engine) -> Engine:
    """`engine` running every iteration in the controls variant: what it did before the plain
    variant existed, the reference here."""
    engine.variant = lambda spans: CONTROLS
    return engine


def record_variants(engine: Engine) -> list[str]:
    """The variants the runner hands the step, in launch order."""
    ran, step = [], engine.runner.step

    def recording(tokens: int, variant: str) -> None:
        ran.append(variant)
        step(tokens, variant)

    engine.runner.step = recording
    return ran


SEEDED = SamplingParams(temperature=0.8, seed=3)
# Slot 1 uses nothing; 2 asks for logprobs under a repetition penalty; 3 is held to a regex;
# 4 has min_tokens and a bias. The batches switch variant, and a controlled slot sits out
# plain iterations between its own.
CONTROLLED = {2: ControlParams(logprobs=3, repetition_penalty=1.5), 3: ControlParams(regex=REGEX),
              4: ControlParams(min_tokens=3, logit_bias={EOS: 100.0, 9: 2.0})}
PROMPTS = {1: [3, 4, 5, 6], 2: [6, 7], 3: [8, 9, 10], 4: [11, 12]}
SCHEDULE = [[1], [1], [1, 2], [1, 2], [1], [1], [2, 3], [1], [1, 3], [3, 4], [1], [4], [1], [1, 4], [2, 4], [1]]
VARIANTS = [PLAIN, PLAIN, CONTROLS, CONTROLS, PLAIN, PLAIN, CONTROLS, PLAIN, CONTROLS, CONTROLS, PLAIN, CONTROLS,
            PLAIN, CONTROLS, CONTROLS, PLAIN]


def run_schedule(engine: Engine, lag: int) -> list[tuple[list[int], list[int], list | None]]:
    """SCHEDULE launched on `engine` (a slot's first iteration prefills it), each iteration
    read `lag` launches later, as the overlap loop reads (lag 2) or no-overlap (0): per
    iteration (slots, tokens, logprobs or None)."""
    started, out, launched = set(), [], []
    with engine.activate():
        for slots in SCHEDULE:
            spans = []
            for slot in slots:
                if slot in started:
                    spans.append(decode_span(slot, SEEDED))
                else:
                    started.add(slot)
                    engine.admit_controls(slot, CONTROLLED.get(slot), (EOS,), PROMPTS[slot])
                    spans.append(prefill_span(slot, SEEDED, PROMPTS[slot], 0, True))
            launched.append(engine.launch(spans))
            while len(launched) > lag:
                read = engine.read(launched.pop(0), block=True)
                logprobs = engine.read_logprobs(read)
                out.append((read.slots.tolist(), read.tokens.tolist(), logprobs))
        for iteration in launched:
            read = engine.read(iteration, block=True)
            out.append((read.slots.tolist(), read.tokens.tolist(), engine.read_logprobs(read)))
    return out


def assert_same_logprobs(logits, got, want, ring_slot: int) -> None:
    """Two LogprobChannels written from the same `logits` hold the same ring slot: stamps and
    counts (all slots), the row slots and which rows asked equal; for the rows that asked (both
    compute those), values within 1e-6 relative, relative to the row's logsumexp where it is
    larger (a value near 0 is a difference of two numbers that size, and the two logsumexps
    sum in different orders: a few ulps apart); on ties the top's
    order is free, so each got id must be distinct and hold the logit the wanted id of its rank
    holds, and equal the wanted id where the wanted value is held by one logit only."""
    for name in ("stamps", "counts"):
        assert torch.equal(got.host[name], want.host[name]), name
    n = int(want.host["counts"][ring_slot])
    for name in ("slots", "asked"):
        assert torch.equal(got.host[name][ring_slot, :n], want.host[name][ring_slot, :n]), name
    asked = want.host["asked"][ring_slot, :n].bool()
    rows = logits[:n].float().cpu()[asked]
    got_values, want_values = got.host["values"][ring_slot, :n][asked], want.host["values"][ring_slot, :n][asked]
    got_ids, want_ids = got.host["ids"][ring_slot, :n][asked], want.host["ids"][ring_slot, :n][asked]
    lse = torch.logsumexp(rows, dim=1, keepdim=True)

    def assert_close(got_v, want_v):
        tolerance = 1e-6 * torch.maximum(want_v.abs(), lse.abs().clamp(min=1.0))
        assert bool(((got_v == want_v) | ((got_v - want_v).abs() <= tolerance)).all()), (got_v, want_v)

    assert_close(got_values, want_values)
    # Each got id holds the logit the wanted id at its rank holds (exactly: ties hold equal ones).
    assert torch.equal(rows.gather(1, got_ids), rows.gather(1, want_ids))
    assert bool((got_ids.sort(dim=1).values.diff(dim=1) > 0).all()), "an id repeats in a row's top"
    unique = (rows[:, None, :] == rows.gather(1, want_ids)[:, :, None]).sum(-1) == 1
    assert torch.equal(got_ids[unique], want_ids[unique])
