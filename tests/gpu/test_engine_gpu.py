"""The engine's one stream: created with cuda-python, handed to torch once, shared by every
engine on the device, and required for queueing work (outside it `launch` refuses,
changing nothing)."""

from __future__ import annotations

import pytest
import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.spans import decode_span, prefill_span
from graphrelay.runtime import Stream

pytestmark = pytest.mark.gpu


def _engine() -> Engine:
    engine = Engine(EngineConfig(ModelConfig.preset("tiny"), max_reqs=2, max_batch=2, device="cuda", max_tokens=8))
    engine.capture()
    return engine


def test_one_cuda_python_stream_handed_to_torch():
    first, second = _engine(), _engine()
    assert first.stream is second.stream is Stream.persistent("cuda")
    assert first.torch_stream.cuda_stream == first.stream.handle != torch.cuda.current_stream().cuda_stream
    first.stream.close()  # a persistent stream outlives a close: other engines still use it
    with second.activate():
        assert torch.cuda.current_stream().cuda_stream == second.stream.handle
        second.stream.synchronize()


def test_work_outside_the_engine_stream_is_refused_without_state_change():
    engine = _engine()
    prompt = [prefill_span(1, SamplingParams(), [3, 4, 5], 0, True)]
    generation = engine.relay.host_generation.clone()
    with pytest.raises(RuntimeError, match="engine.activate"):
        engine.launch(prompt)
    with pytest.raises(RuntimeError, match="engine.activate"):
        engine.launch([decode_span(1, SamplingParams())])
    assert engine.iterations_launched == 0 and torch.equal(engine.relay.host_generation, generation)
    with engine.activate():
        assert engine.launch(prompt) == 0
        assert engine.launch([decode_span(1, SamplingParams())]) == 1
        read = engine.read(1, block=True)
    assert read is not None and engine.iterations_launched == 2
