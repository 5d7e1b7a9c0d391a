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
from graphrelay.capture.iteration.spec_step import SpecConfig  # noqa: E402
from graphrelay.capture.iteration.surface import DecodeInputs  # noqa: E402
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
    engine = Engine(EngineConfig(ModelConfig(), max_reqs=8, max_batch=4, use_graphs=False))
    return _through_surface(engine.inputs, engine.step)


def spec_decode_step():
    """The speculative iteration: drafting, verify, acceptance, relay and mirror, as captured."""
    engine = Engine(EngineConfig(ModelConfig(), max_reqs=8, max_batch=4, use_graphs=False, spec=SpecConfig(k=3)))
    return _through_surface(engine.inputs, engine.step)


def _controls() -> ControlsConfig:
    return ControlsConfig(max_bias=4, max_stop=2, grammar_states=4,
                          backend="triton" if os.environ.get("TRITON_INTERPRET") == "1" else None)


def decode_step_controls():
    """The decode step with every sampling control and logprobs in the graph."""
    engine = Engine(EngineConfig(ModelConfig(), max_reqs=8, max_batch=4, use_graphs=False, controls=_controls()))
    return _through_surface(engine.inputs, engine.step)


def spec_decode_step_controls():
    """The speculative step with the controls: verify rows see their drafts' counts and states."""
    engine = Engine(EngineConfig(ModelConfig(), max_reqs=8, max_batch=4, use_graphs=False, spec=SpecConfig(k=3),
                                 controls=_controls()))
    return _through_surface(engine.inputs, engine.step)


def _through_surface(inputs: DecodeInputs, step):
    """(run, example inputs) that write a padded bucket of 4 into the surface, then step."""

    def run(slots, temperature, top_k, seeds, top_p):
        # The surface's device buffers are what the graph reads; write them, then step.
        view = inputs.narrow(slots.shape[0])
        for dst, src in ((view.slots, slots), (view.temperature, temperature), (view.top_k, top_k),
                         (view.seeds, seeds), (view.top_p, top_p)):
            dst.copy_(src)
        step(slots.shape[0])

    return run, (_SLOTS.clone(), torch.tensor([0.0, 0.0, 0.7, 1.0]), torch.tensor([0, 0, 5, 0], dtype=torch.int32),
                 torch.tensor([11, 0, 12, 13]), torch.tensor([1.0, 1.0, 0.9, 0.8]))
