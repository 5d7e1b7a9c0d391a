"""Requests are checked where they are made and against the engine before a run starts: every
field the engine stores must fit how it stores it, and nothing that could never take effect
(an unreachable stop token, an arrival that never comes due) is accepted silently."""

from __future__ import annotations

import logging
import math

import pytest
import transformers

from graphrelay.capture.iteration.engine import EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.request_checks import check_requests
from graphrelay.capture.serving.workloads import MAX_ARRIVAL_S, Request, WorkloadError, load_jsonl

TINY = ModelConfig.preset("tiny")


@pytest.mark.parametrize("fields, message", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be an int >= 1, got 2.5"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),
    (dict(prompt=[1.5]), "prompt token ids must be ints >= 0, got 1.5"),
    (dict(prompt=[]), "prompt must be a non-empty list"),
    (dict(sampling={"temperature": 1.0}), "sampling must be a SamplingParams"),
    (dict(stop_tokens=(-1,)), r"stop_tokens must be token ids \(ints >= 0\), got -1"),
    (dict(arrival=math.nan), "arrival must be seconds after the run starts"),
    (dict(arrival=math.inf), "arrival must be seconds after the run starts"),
    (dict(arrival=MAX_ARRIVAL_S + 1), "arrival must be seconds after the run starts, 0..3600"),
    (dict(stop=("",)), "stop strings must be non-empty"),
])
def test_a_request_refuses_what_it_cannot_mean(fields, message):
    with pytest.raises(ValueError, match=message):
        Request(**{"id": "r", "prompt": [1, 2], "max_new_tokens": 3, **fields})


def config(**overrides) -> EngineConfig:
    return EngineConfig(TINY, max_reqs=4, max_batch=4, **overrides)


@pytest.mark.parametrize("request_fields, engine, message", [
    (dict(sampling=SamplingParams(temperature=1.0, top_k=3_000_000_000)), {},
     r"request 'r': sampling top_k 3000000000 is above the engine's top-k width 64 \(--max-top-k"),
    (dict(sampling=SamplingParams(temperature=1.0, top_k=65)), {}, "top_k 65 is above the engine's top-k width 64"),
    (dict(sampling=SamplingParams(temperature=1.0, top_k=3_000_000_000)), dict(max_top_k=None),
     "top_k 3000000000 does not fit the engine's int32 top-k column"),
    (dict(sampling=SamplingParams(temperature=1e39)), {}, "temperature 1e\\+39 overflows float32"),
    (dict(stop_tokens=(99_999_999,)), {}, "stop token 99999999 is outside the vocabulary 0..511, so it could never match"),
    (dict(prompt=[512]), {}, "token id 512 >= vocab_size 512"),
    (dict(max_new_tokens=300), {}, r"prompt \(2\) \+ max_new_tokens \(300\) exceeds the model's max_seq_len 256"),
])
def test_requests_the_engine_cannot_store_are_refused_before_the_run(request_fields, engine, message):
    fine = Request(id="ok", prompt=[1], max_new_tokens=2)
    bad = Request(**{"id": "r", "prompt": [1, 2], "max_new_tokens": 3, **request_fields})
    check_requests([fine], config(**engine))
    with pytest.raises(ValueError, match=message):
        check_requests([fine, bad], config(**engine))


def test_duplicate_ids_name_the_id():
    one = Request(id="same", prompt=[1], max_new_tokens=2)
    with pytest.raises(ValueError, match="request 'same': duplicate request id"):
        check_requests([one, one], config())


def test_request_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": [1, 2], "max_new_tokens": 3}\n{"prompt": [4], "max_new_tokens": 1}\n')
    assert [r.prompt for r in load_jsonl(path)] == [[1, 2], [4]]


def test_a_far_future_arrival_in_a_file_is_refused_with_its_line(tmp_path):
    path = tmp_path / "late.jsonl"
    path.write_text('{"prompt": [1], "max_new_tokens": 2}\n{"prompt": [1], "max_new_tokens": 2, "arrival": 1e9}\n')
    with pytest.raises(WorkloadError, match=f"{path}:2: .*arrival must be seconds after the run starts, 0..3600"):
        load_jsonl(path)


def test_text_requests_add_their_stop_tokens_to_the_end_of_turn_ones(tmp_path, codec):
    path = tmp_path / "text.jsonl"
    path.write_text('{"prompt": "Hi", "max_new_tokens": 4, "stop_tokens": [42]}\n{"prompt": "Hi", "max_new_tokens": 4}\n')
    with_own, plain = load_jsonl(path, codec)
    assert plain.stop_tokens == codec.stop_tokens
    assert with_own.stop_tokens == (*codec.stop_tokens, 42)


def test_chat_roles_outside_the_templates_vocabulary_are_refused(codec):
    codec.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="messages\\[0\\]: role 'wizard' is not one of system, user, assistant, tool"):
        codec.encode_chat([{"role": "wizard", "content": "Hi"}])


def test_decoding_prints_no_tokenizer_warning(codec):
    """transformers warned "Ignoring clean_up_tokenization_spaces" once per process into every run."""
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers")
    transformers.utils.logging.warning_once.cache_clear()  # an earlier test may have warned already
    logger.addHandler(handler)
    try:
        text = codec.decode(codec.encode("Hello , world !"))
    finally:
        logger.removeHandler(handler)
    assert text == "Hello , world !"  # the spaces before punctuation stay, as before
    assert not [m for m in seen if "clean_up_tokenization_spaces" in m]
