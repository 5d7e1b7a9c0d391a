"""`graphrelay serve --requests` with stop strings: the text ends exactly before the first stop
string and the request finishes "stop"; and the HTTP flags refuse what does not go with them
before any model loads."""

from __future__ import annotations

import json

from graphrelay.capture.serving.cli import serve_main

TINY_TEXT = ["--model", "tiny", "--weights", "random", "--tokenizer", "--device", "cpu", "--quiet", "--show", "0",
             "--max-seq-len", "128"]


def _run(tmp_path, lines: list[dict]) -> dict:
    path, out = tmp_path / "requests.jsonl", tmp_path / "out.json"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert serve_main([*TINY_TEXT, "--requests", str(path), "--json", str(out)]) == 0
    return {o["id"]: o for o in json.loads(out.read_text())["outputs"]}


def test_stop_strings_cut_the_text_exactly(tmp_path):
    prompt = {"prompt": "Once upon a time", "max_new_tokens": 30}
    full = _run(tmp_path, [{"id": "full", **prompt}])["full"]
    assert full["finish_reason"] == "length"
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    outputs = _run(tmp_path, [{"id": "list", **prompt, "stop": [stop, "\x00never"]}, {"id": "one", **prompt, "stop": stop},
                              {"id": "none", **prompt}])
    for rid in ("list", "one"):
        cut = outputs[rid]
        assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"
        assert cut["tokens"] == full["tokens"][: len(cut["tokens"])] and len(cut["tokens"]) < len(full["tokens"])
    assert outputs["none"]["text"] == text and outputs["none"]["tokens"] == full["tokens"]


def test_stop_strings_need_a_tokenizer(tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": [1, 2, 3], "max_new_tokens": 4, "stop": ["x"]}\n')
    assert serve_main(["--model", "tiny", "--device", "cpu", "--quiet", "--requests", str(path)]) == 2
    assert "stop strings need a model with a tokenizer" in capsys.readouterr().err


def test_http_flags_refuse_what_does_not_go_with_them(tmp_path, capsys):
    tiny = ["--model", "tiny", "--device", "cpu", "--quiet"]
    assert serve_main([*tiny, "--port", "0", "--synthetic"]) == 2
    assert "--synthetic runs a workload and exits" in capsys.readouterr().err
    assert serve_main([*tiny, "--port", "0", "--tp", "2"]) == 2
    assert "--tp 1" in capsys.readouterr().err
    assert serve_main([*tiny, "--port", "70000"]) == 2
    assert "0..65535" in capsys.readouterr().err
    assert serve_main([*tiny, "--port", "0"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
