"""The project's own capture-critical code, as `graphrelay lint` targets (run in CI).

Each factory returns `(step, example_inputs)`: the relay ops (torch and Triton backends), the
host-mirror write, and the decode steps the serving loop replays every iteration (relay
resolve -> model -> sampling -> stash + publish -> mirror write), plain and speculative. On a machine without a GPU
the Triton kernels run under TRITON_INTERPRET=1 (set here before Triton is imported).

    graphrelay lint tools/lint_targets.py:relay_resolve_triton tools/lint_targets.py:decode_step ...
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphrelay.capture.iteration.controls.state import ControlsConfig  # noqa: E402
from graphrelay.capture.iteration.engine import Engine, EngineConfig  # noqa: E402
from graphrelay.capture.model.model import ModelConfig  # noqa: E402
from graphrelay.capture.iteration.ngram import SpecConfig  # noqa: E402
from graphrelay.capture.iteration.inputs import IterationInputs  # noqa: E402
from graphrelay.capture.iteration.sampling import SamplingParams  # noqa: E402
from graphrelay.capture.iteration.spans import decode_span, prefill_span  # noqa: E402
from graphrelay import FieldSpec, HostMirror, Relay, RelayConfig, RelayPayload  # noqa: E402

TARGETS = (
    "relay_resolve_torch",
    "relay_resolve_triton",
    "relay_scatter_torch",
    "relay_scatter_triton",
    "mirror_write",
    "decode_step",
    "spec_decode_step",
    "decode_step_controls",
    "spec_decode_step_controls",
)

_CONFIG = RelayConfig.eagle(8, 4, topk=4, hidden_size=16, confidence=FieldSpec((3,), "float32"))
_SLOTS = torch.tensor([3, 0, 5, 1])  # a padded bucket of 4


def _relay(backend: str) -> Relay:
    # validate=False: what runs in capture (host checks read index values, i.e. sync).
    return Relay(_CONFIG, "cpu", backend=backend, validate=False)


def _resolve(backend: str):
    relay = _relay(backend)
    out = relay.alloc_resolved(_SLOTS.shape[0])
    return (lambda slots: relay.resolve(slots, out=out)), (_SLOTS.clone(),)


def _scatter(backend: str):
    relay = _relay(backend)
    bs = _SLOTS.shape[0]
    payload = RelayPayload(
        tokens=torch.randint(0, 100, (bs,)),
        topk_p=torch.rand(bs, 4),
        topk_index=torch.randint(0, 100, (bs, 4)),
        hidden=torch.randn(bs, 16),
    )

    def step(slots, tokens, seq_lens, confidence):
        relay.stash_and_publish(slots, RelayPayload(tokens, payload.topk_p, payload.topk_index, payload.hidden), seq_lens, confidence)

    return step, (_SLOTS.clone(), payload.tokens, torch.randint(1, 50, (bs,)), torch.rand(bs, 3))


def relay_resolve_torch():
    return _resolve("torch")


def relay_resolve_triton():
    return _resolve("triton")


def relay_scatter_torch():
    return _scatter("torch")


def relay_scatter_triton():
    return _scatter("triton")


def mirror_write():
    config = RelayConfig.plain(8, 4)
    mirror = HostMirror(Relay(config, "cpu"), use_triton=os.environ.get("TRITON_INTERPRET") == "1", validate=False)
    return (lambda slots, tokens, seq_lens: mirror.write(slots, tokens, seq_lens)), (
        _SLOTS.clone(), torch.randint(0, 100, (4,)), torch.randint(1, 50, (4,)).int())


def decode_step():
    """The serving loop's per-iteration device work: the step its graphs capture."""
    engine = Engine(EngineConfig(ModelConfig(), max_reqs=8, max_batch=4, use_graphs=False, max_tokens=16))
    return _through_inputs(engine.inputs, engine.step, engine.config.tokens_per_decode)


def spec_decode_step():
    """The speculative iteration: drafting, verify, acceptance, relay and mirror, as captured."""
    engine = Engine(EngineConfig(ModelConfig(), max_reqs=8, max_batch=4, use_graphs=False, spec=SpecConfig(k=3),
                                 max_tokens=24))
    return _through_inputs(engine.inputs, engine.step, engine.config.tokens_per_decode)


def _controls() -> ControlsConfig:
    return ControlsConfig(max_bias=4, max_stop=2, grammar_states=4,
                          backend="triton" if os.environ.get("TRITON_INTERPRET") == "1" else None)


def decode_step_controls():
    """The iteration with every sampling control and logprobs in the graph."""
    engine = Engine(EngineConfig(ModelConfig(), max_reqs=8, max_batch=4, use_graphs=False, max_tokens=16,
                                 controls=_controls()))
    return _through_inputs(engine.inputs, engine.step, engine.config.tokens_per_decode)


def spec_decode_step_controls():
    """The speculative iteration with the controls: verify rows see their drafts' counts and states."""
    engine = Engine(EngineConfig(ModelConfig(), max_reqs=8, max_batch=4, use_graphs=False, spec=SpecConfig(k=3),
                                 max_tokens=24, controls=_controls()))
    return _through_inputs(engine.inputs, engine.step, engine.config.tokens_per_decode)


def _through_inputs(inputs: IterationInputs, step, decode_tokens: int):
    """(run, example inputs) that lay out a mixed iteration (two decode spans, a prompt chunk)
    in its token bucket's input buffers, then step: the token ids are the example input."""
    bucket = inputs.max_tokens
    spans = [decode_span(3, SamplingParams()), decode_span(5, SamplingParams(temperature=0.7, top_k=5, seed=12)),
             prefill_span(1, SamplingParams(top_p=0.9, temperature=1.0, seed=13), [7, 8, 9], 0, True)]
    inputs.load(spans, bucket, decode_tokens)

    def run(ids):
        # The device buffers are what the graph reads; write the ids, then step.
        inputs.buffers.ids[: ids.shape[0]].copy_(ids)
        step(bucket)

    return run, (inputs.buffers.ids[:bucket].clone(),)
