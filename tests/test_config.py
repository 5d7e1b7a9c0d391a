"""RelayConfig: presets, loading from JSON/TOML, and validation naming the field and the fix."""

from __future__ import annotations

import pytest

from graphrelay import FieldSpec, RelayConfig


def test_presets():
    plain = RelayConfig.plain(64, 16)
    assert plain.rows == 65 and plain.hidden is None and plain.topk_p is None
    eagle = RelayConfig.eagle(64, 16, topk=8, hidden_size=4096)
    assert eagle.topk_p.shape == (8,) and eagle.topk_index.dtype == "int64"
    assert eagle.hidden == FieldSpec((4096,), "bfloat16")


def test_json_round_trip_and_toml(tmp_path):
    eagle = RelayConfig.eagle(32, 8, topk=4, hidden_size=256)
    path = tmp_path / "relay.json"
    path.write_bytes(eagle.to_json())
    assert RelayConfig.load(path) == eagle
    toml = tmp_path / "relay.toml"
    toml.write_text('max_reqs = 4\nmax_batch = 2\nseq_len_fill = 0\n[confidence]\nshape = [3]\ndtype = "float32"\n')
    loaded = RelayConfig.load(toml)
    assert loaded.confidence == FieldSpec((3,), "float32") and loaded.seq_len_fill == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_reqs=0, max_batch=1), "max_reqs must be a positive int"),
        (dict(max_reqs=4, max_batch=-2), "max_batch must be a positive int"),
        (dict(max_reqs=4, max_batch=2, token_dtype="float32"), "token_dtype"),
        (dict(max_reqs=4, max_batch=2, pad_token_id=-1), "pad_token_id"),
        (dict(max_reqs=4, max_batch=2, seq_len_fill=-1), "seq_len_fill"),
        (dict(max_reqs=4, max_batch=2, topk_p=FieldSpec((4,), "float32")), "come together"),
        (dict(max_reqs=4, max_batch=2, topk_p=FieldSpec((4,), "float32"), topk_index=FieldSpec((3,), "int64")), "must equal"),
        (dict(max_reqs=4, max_batch=2, sparse_topk=FieldSpec((4,), "float32")), "sparse_topk.dtype"),
        (dict(max_reqs=4, max_batch=2, accept_len=FieldSpec((2,), "int32")), "accept_len"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RelayConfig(**kwargs)


def test_field_spec_validation():
    with pytest.raises(ValueError, match="not supported"):
        FieldSpec((4,), "complex64")
    with pytest.raises(ValueError, match="positive ints"):
        FieldSpec((0,), "int32")


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="invalid RelayConfig.*max_batch"):
        RelayConfig.from_json(b'{"max_reqs": 4, "max_batch": 0}')
    with pytest.raises(ValueError, match="invalid RelayConfig"):
        RelayConfig.from_json(b'{"max_reqs": 4, "max_batch": 2, "typo_field": 1}')
    with pytest.raises(ValueError, match=r"\.json or \.toml"):
        RelayConfig.load(tmp_path / "relay.yaml")
