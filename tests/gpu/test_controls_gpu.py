"""The sampling controls on a GPU: the Triton kernels equal the torch reference at a real
vocabulary size, and an engine whose captured graphs apply every control produces exactly what
the same engine run eagerly produces, plain and speculative, with no host sync in the loop."""

from __future__ import annotations

import json

import pytest
import torch

from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, vocabulary
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig, SamplingControls
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import SyntheticWorkload
from controls_cases import EOS, REGEX, SCHEMA, STRINGS, msgspec_replace

pytestmark = pytest.mark.gpu

MODEL = ModelConfig.preset("tiny")


def loaded_controls(backend: str, vocab: int = 49152, rows: int = 64) -> SamplingControls:
    torch.manual_seed(0)
    c = SamplingControls(ControlsConfig(backend=backend), max_reqs=rows, vocab_size=vocab, max_rows=rows, device="cuda")
    for slot in range(1, rows + 1):
        c.admit(slot, ControlParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2, min_tokens=4,
                                    logit_bias={slot: 5.0, vocab - slot: -5.0}), (7, 9), list(range(slot, slot + 40)))
    slots = torch.arange(1, rows + 1, device="cuda")
    for _ in range(30):
        c.observe(slots, torch.randint(0, vocab, (rows,), device="cuda"), c.row_states(slots))
    c.grammar.allowed[1:3] = torch.randint(-(2**31), 2**31 - 1, (2, c.grammar.allowed.shape[1]), dtype=torch.int32)
    c.slot_state[1 : rows + 1 : 2] = 1
    return c


def test_triton_apply_equals_torch_at_a_real_vocabulary():
    rows, vocab = 64, 49152
    logits = torch.randn(rows, vocab, device="cuda") * 4
    slots = torch.arange(1, rows + 1, device="cuda")
    steps = torch.arange(rows, device="cuda") + 38
    results = {}
    for backend in ("torch", "triton"):
        c = loaded_controls(backend)
        results[backend] = c.apply(logits, slots, steps, c.row_states(slots)).clone()
    torch.testing.assert_close(results["triton"], results["torch"])
    assert torch.isinf(results["torch"]).any()


def requests(spec: bool):
    controls = [dict(frequency_penalty=0.4, logprobs=3), dict(repetition_penalty=1.3, logit_bias={5: 3.0}),
                dict(min_tokens=6), dict(regex=REGEX), dict(json_schema=json.dumps(SCHEMA)), {}]
    base = SyntheticWorkload(num_requests=12, prompt_len=(4, 12), output_len=(24, 40), vocab_size=6 if spec else 512,
                             seed=9).requests()
    return [msgspec_replace(r, stop_tokens=(EOS,), sampling=SamplingParams(temperature=0.8 * (i % 2), seed=i),
                            controls=ControlParams(**controls[i % len(controls)]) if controls[i % len(controls)] else None)
            for i, r in enumerate(base)]


def run(use_graphs: bool, spec: bool):
    engine = Engine(EngineConfig(MODEL, max_reqs=8, max_batch=4, device="cuda", use_graphs=use_graphs, max_tokens=32,
                                 buckets=(32,), spec=SpecConfig(k=3) if spec else None,
                                 controls=ControlsConfig(grammar_states=512)))
    engine.controls.set_compiler(GrammarCompiler(vocabulary(STRINGS, EOS), MODEL.vocab_size))
    engine.capture()
    return ServingLoop(engine, "overlap" if use_graphs else "eager").run(requests(spec))


@pytest.mark.parametrize("spec", [False, True])
def test_captured_controls_equal_eager_with_no_host_sync(spec):
    graphs, eager = run(True, spec), run(False, spec)
    assert graphs.stats.graphs and graphs.stats.host_syncs == 0
    for rid, out in eager.outputs.items():
        assert graphs.outputs[rid].tokens == out.tokens, rid
        if out.logprobs is not None:
            got = graphs.outputs[rid].logprobs
            assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in out.logprobs], rid
            assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in out.logprobs], rel=1e-4, abs=1e-5)
