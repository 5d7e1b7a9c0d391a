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
        (dict(max_reqs=4, max_batch=2, pad_token_id=1.5), r"pad_token_id must be an int .*got 1.5"),
        (dict(max_reqs=4, max_batch=2, pad_token_id=True), "pad_token_id must be an int"),
        (dict(max_reqs=4, max_batch=2, pad_token_id=2**31), r"pad_token_id must be in \[0, 2147483647\].*int32"),
        (dict(max_reqs=4, max_batch=2, token_dtype="int16", pad_token_id=40000), r"\[0, 32767\]"),
        (dict(max_reqs=4, max_batch=2, seq_len_fill=2.0), "seq_len_fill must be an int"),
        (dict(max_reqs=4, max_batch=2, seq_len_dtype="int8", seq_len_fill=128), r"seq_len_fill must be in \[0, 127\]"),
        (dict(max_reqs=4, max_batch=2, debug="false"), "debug must be True or False"),
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


def test_fill_values_at_the_dtype_limits_are_accepted():
    config = RelayConfig(max_reqs=4, max_batch=2, token_dtype="int64", pad_token_id=2**40, seq_len_fill=0)
    assert config.pad_token_id == 2**40


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_debug_switch_truthy_spellings(monkeypatch, raw):
    monkeypatch.setenv("GRAPHRELAY_DEBUG", raw)
    assert RelayConfig.plain(4, 2).debug_enabled


@pytest.mark.parametrize("raw", ["", "0", "false", "False", "no", "OFF"])
def test_debug_switch_falsy_spellings(monkeypatch, raw):
    monkeypatch.setenv("GRAPHRELAY_DEBUG", raw)
    assert not RelayConfig.plain(4, 2).debug_enabled
    assert RelayConfig.plain(4, 2, debug=True).debug_enabled


@pytest.mark.parametrize("raw", ["2", "enabled", "y"])
def test_debug_switch_rejects_other_values(monkeypatch, raw):
    monkeypatch.setenv("GRAPHRELAY_DEBUG", raw)
    with pytest.raises(ValueError, match=f"GRAPHRELAY_DEBUG={raw!r} is not a boolean.*1/0, true/false, yes/no, on/off"):
        RelayConfig.plain(4, 2).debug_enabled


@pytest.mark.parametrize("name, text", [("relay.toml", "max_reqs = [\n"), ("relay.json", '{"max_reqs": ')])
def test_a_malformed_file_is_named(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=f"RelayConfig file {path}: malformed RelayConfig"):
        RelayConfig.load(path)
    with pytest.raises(ValueError, match=f"cannot read RelayConfig file {tmp_path / 'missing.toml'}"):
        RelayConfig.load(tmp_path / "missing.toml")
