"""What the controls tests share: a made-up text vocabulary for the tiny model, its EOS, a
JSON schema and a regex whose matches are short enough for a few dozen tokens, and a schedule
of iterations that switch between the engine's plain and controls step variants."""

from __future__ import annotations

import msgspec

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
