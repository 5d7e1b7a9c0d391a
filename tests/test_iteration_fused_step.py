"""The whole iteration on the fused prologue and epilogue (the CUDA default; interpreted here)
against the same iteration on the torch glue (the CPU default): the same mirror reads and the
same relay rows, KV caches, logits and placements after every iteration of a changing batch,
and the same tokens through the serving loop, plain and speculative, greedy and seeded."""

from __future__ import annotations

import pytest

from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, vocabulary
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.iteration.step import IterationStep
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import SyntheticWorkload
from capture_cases import Driver, assert_same_read, assert_same_state, build_stack, composition_schedule, step_state
from controls_cases import EOS, REGEX, STRINGS, msgspec_replace

MAX_REQS, MAX_BATCH, MAX_TOKENS = 10, 8, 128
STEPS = 12


def fuse(engine: Engine) -> IterationStep:
    """Rebuild `engine`'s step over the same parts on the fused kernels, and run that one."""
    step = IterationStep(engine.relay, engine.model, engine.mirror, engine.inputs, spec=engine.config.spec,
                         history=engine.history, max_top_k=engine.config.max_top_k, controls=engine.controls,
                         backend="triton")
    engine.step = engine.runner.step = step
    return step


@pytest.mark.parametrize("max_top_k", [None, 64], ids=["whole-vocab", "ranked-64"])
def test_fused_iterations_equal_the_glue_state_for_state(max_top_k):
    """Requests join and leave every iteration, batches are padded to token buckets; after each
    iteration the fused twin's mirror read and whole state equal the glue's bit for bit. With a
    ranked width the Triton sampler can rank (the engine's default), the fused epilogue also
    picks the tokens; over the whole vocabulary the step samples first and the epilogue reads
    its tokens."""
    sizes = dict(max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS, max_top_k=max_top_k)
    glue, fused = Driver(build_stack("cpu", **sizes)), Driver(build_stack("cpu", **sizes))
    step = fuse(fused.stack.engine)
    fused.stack.step = step
    assert step.prologue.backend == "triton" and step.fused_epilogue
    assert step.pick_in_epilogue == (max_top_k is not None)
    assert glue.stack.step.prologue.backend == "torch" and not glue.stack.step.fused_epilogue
    for n, plan in enumerate(composition_schedule(STEPS, MAX_REQS, MAX_BATCH, seed=3)):
        buckets = [driver.apply(plan) for driver in (glue, fused)]
        assert buckets[0] == buckets[1]
        context = f"iteration {n} (bucket {buckets[0]})"
        assert_same_read(fused.read(n), glue.read(n), context)
        assert_same_state(step_state(fused.stack, buckets[0]), step_state(glue.stack, buckets[0]), context)


def serve(spec, temperature: float, fused: bool) -> dict[str, list[int]]:
    tokens = 2 * MAX_BATCH * (spec.rows if spec else 1)
    engine = Engine(EngineConfig(ModelConfig.preset("tiny"), max_reqs=MAX_REQS, max_batch=MAX_BATCH,
                                 max_tokens=tokens, buckets=(tokens,), spec=spec, use_graphs=False))
    if fused:
        step = fuse(engine)
        # Speculation writes its drafts into the ids after the prologue: the model embeds them.
        assert step.fused_epilogue == step.pick_in_epilogue == (spec is None)
        assert (step.prologue.buffers.embedded is None) == (spec is not None)
    engine.capture()
    requests = SyntheticWorkload(num_requests=8, prompt_len=(2, 14), output_len=(2, 12), vocab_size=12, seed=4,
                                 temperature=temperature).requests()
    result = ServingLoop(engine, "overlap").run(requests)
    return {rid: out.tokens for rid, out in result.outputs.items()}


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [None, SpecConfig(k=3, min_n=1, max_n=3)], ids=["plain", "ngram"])
def test_fused_step_serves_the_same_tokens(spec, temperature):
    """The serving loop over the fused step emits exactly the glue step's tokens."""
    assert serve(spec, temperature, fused=True) == serve(spec, temperature, fused=False)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_fused_epilogue_with_controls_serves_the_same_tokens_and_logprobs(temperature):
    """Without speculation the controls variant fuses the epilogue too (the controls count,
    advance and write logprobs before it): controlled requests, some asking for logprobs, beside
    plain ones, give the glue step's tokens and logprobs."""
    kinds = [dict(frequency_penalty=0.7, logprobs=3), dict(logit_bias={5: 4.0}, min_tokens=4), dict(regex=REGEX),
             dict(repetition_penalty=1.4, logprobs=0), {}]

    def run(fused: bool):
        tokens = 2 * MAX_BATCH
        engine = Engine(EngineConfig(ModelConfig.preset("tiny"), max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=tokens,
                                     buckets=(tokens,), use_graphs=False, controls=ControlsConfig(grammar_states=256)))
        engine.controls.set_compiler(GrammarCompiler(vocabulary(STRINGS, EOS), engine.config.model.vocab_size))
        if fused:
            assert fuse(engine).fused_epilogue
        engine.capture()
        base = SyntheticWorkload(num_requests=10, prompt_len=(2, 14), output_len=(6, 16), vocab_size=64, seed=6).requests()
        requests = [msgspec_replace(r, stop_tokens=(EOS,), sampling=SamplingParams(temperature=temperature, seed=i),
                                    controls=ControlParams(**kinds[i % len(kinds)]) if kinds[i % len(kinds)] else None)
                    for i, r in enumerate(base)]
        result = ServingLoop(engine, "overlap").run(requests)
        return {rid: (out.tokens, out.logprobs) for rid, out in result.outputs.items()}

    fused, glue = run(True), run(False)
    assert fused == glue
    assert sum(logprobs is not None for _, logprobs in glue.values()) == 4
