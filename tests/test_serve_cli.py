"""`graphrelay serve`: the main job runs on its default, writes JSON, and reports bad input
in one line naming the problem (and the file line), with no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from graphrelay.capture.iteration.engine import EngineConfig
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.cli import generate_main, serve_main

ROOT = Path(__file__).resolve().parents[1]
# Every time limit here bounds a hang, not a speed: a busy 2-core machine may take minutes.
HANG_S = 600


def test_serve_small_workload_prints_summary_and_writes_json(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert serve_main(["--model", "tiny", "--device", "cpu", "--quiet", "--num-requests", "6", "--output-len", "2,5",
                       "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for label in ("requests", "tokens/s", "p99", "host syncs", "GPU idle"):
        assert label in printed, label
    report = json.loads(out.read_text())
    assert report["stats"]["requests"] == 6 and len(report["outputs"]) == 6
    assert report["stats"]["tokens"] == sum(len(o["tokens"]) for o in report["outputs"])
    assert all(2 <= len(o["tokens"]) <= 5 for o in report["outputs"])


def test_request_file_errors_name_the_line(tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": [1, 2], "max_new_tokens": 3}\n\n{"prompt": [1], "max_new_tokens": "many"}\n')
    tiny = ["--model", "tiny", "--device", "cpu", "--quiet"]
    assert serve_main([*tiny, "--requests", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3" in err and "max_new_tokens" in err
    assert serve_main([*tiny, "--requests", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read request file" in capsys.readouterr().err
    path.write_bytes(b'{"prompt": [1], "max_new_tokens": 3}\n{"prompt": [1], "max_new_tokens": 3, "id": "\xff"}\n')
    assert serve_main([*tiny, "--requests", str(path)]) == 2
    assert f"{path}:2: not UTF-8" in capsys.readouterr().err
    path.write_text('{"prompt": "text needs a tokenizer", "max_new_tokens": 3}\n')
    assert serve_main([*tiny, "--requests", str(path)]) == 2
    assert "need a model with a tokenizer" in capsys.readouterr().err


def test_request_ids_may_hold_line_separators(tmp_path, capsys):
    """U+2028 is a character inside a JSON string, not a line break."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"id": "a\u2028b", "prompt": [5, 6], "max_new_tokens": 2}\n', encoding="utf-8")
    out = tmp_path / "out.json"
    assert serve_main(["--model", "tiny", "--device", "cpu", "--quiet", "--requests", str(path), "--json", str(out)]) == 0
    assert [o["id"] for o in json.loads(out.read_text())["outputs"]] == ["a\u2028b"]


def test_json_path_is_checked_before_the_run(tmp_path, capsys):
    tiny = ["--model", "tiny", "--device", "cpu", "--quiet"]
    assert serve_main([*tiny, "--json", str(tmp_path / "no" / "such" / "dir.json")]) == 2
    assert "does not exist; create it first" in capsys.readouterr().err
    assert serve_main([*tiny, "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_request_file_runs(tmp_path, capsys):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"id": "a", "prompt": [5, 6, 7], "max_new_tokens": 4}\n{"prompt": [9], "max_new_tokens": 2, "stop_tokens": [3]}\n')
    out = tmp_path / "out.json"
    assert serve_main(["--model", "tiny", "--device", "cpu", "--quiet", "--requests", str(path), "--json", str(out)]) == 0
    outputs = {o["id"]: o for o in json.loads(out.read_text())["outputs"]}
    assert set(outputs) == {"a", "2"} and len(outputs["a"]["tokens"]) == 4


def test_bad_arguments_exit_2_without_traceback():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for args in (["--mode", "fast"], ["--prompt-len", "9,2"], ["--buckets", "0,4"], ["--device", "mps"],
                 ["--kv-cache-dtype", "int8"]):
        done = subprocess.run([sys.executable, "-m", "graphrelay.tools.cli", "serve", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=HANG_S)
        assert done.returncode == 2, args
        assert "Traceback" not in done.stderr and "error:" in done.stderr, args
    done = subprocess.run([sys.executable, "-m", "graphrelay.tools.cli", "serve", "--device", "cuda"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2 and "no GPU" in done.stderr and "Traceback" not in done.stderr


def test_default_serve_answers_chat_prompts_with_the_real_model(capsys):
    """The README's main job: the real model on the built-in chat prompts, readable answers."""
    assert serve_main(["--device", "cpu", "--quiet", "--max-new-tokens", "24", "--show", "8"]) == 0
    printed = capsys.readouterr().out
    assert "What is the capital of France?" in printed and "Paris" in printed
    assert "requests        8" in printed


def test_text_and_chat_requests_from_a_file(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        '{"id": "text", "prompt": "What is the capital of France?", "max_new_tokens": 16}\n'
        '{"id": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new_tokens": 16}\n'
    )
    out = tmp_path / "out.json"
    assert serve_main(["--device", "cpu", "--quiet", "--requests", str(path), "--json", str(out), "--show", "0"]) == 0
    outputs = {o["id"]: o for o in json.loads(out.read_text())["outputs"]}
    assert outputs["text"]["tokens"] == outputs["chat"]["tokens"]  # the same chat-templated prompt
    assert "Paris" in outputs["chat"]["text"] and outputs["chat"]["finish_reason"] == "stop"


def test_bad_numbers_and_streams_are_refused_clearly(tmp_path, capsys):
    tiny = ["--model", "tiny", "--device", "cpu", "--quiet"]
    assert serve_main([*tiny, "--rate", "nan"]) == 2
    assert "rate must be a finite number" in capsys.readouterr().err
    # Any workload seed works: request seeds are derived inside int64.
    assert serve_main([*tiny, "--num-requests", "2", "--output-len", "1,2", "--seed", str(2**62)]) == 0
    capsys.readouterr()
    assert serve_main([*tiny, "--requests", "/dev/zero"]) == 2  # one endless line: refused, not read whole
    assert "line longer than" in capsys.readouterr().err
    assert serve_main([*tiny, "--max-reqs", "100000000", "--max-seq-len", "4096"]) == 2
    err = capsys.readouterr().err
    assert "GiB" in err and "lower --max-reqs or --max-seq-len" in err and "Traceback" not in err


def test_serve_tensor_parallel_on_cpu_matches_one_rank(tmp_path, capsys):
    """`--tp 2` spawns two gloo ranks: the same tokens as one rank, every rank's relay equal,
    no host syncs; a model whose heads do not split and a --tp below 1 are refused up front."""
    tiny = ["--model", "tiny", "--device", "cpu", "--quiet", "--num-requests", "5", "--output-len", "3,9",
            "--temperature", "0.8"]
    one, two = tmp_path / "tp1.json", tmp_path / "tp2.json"
    assert serve_main([*tiny, "--json", str(one)]) == 0
    capsys.readouterr()
    assert serve_main([*tiny, "--tp", "2", "--json", str(two)]) == 0
    printed = capsys.readouterr().out
    assert "2 ranks; host syncs per rank [0, 0]; relay contents identical on every rank: yes" in printed
    tokens = [{o["id"]: o["tokens"] for o in json.loads(p.read_text())["outputs"]} for p in (one, two)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 5
    assert serve_main(["--tp", "2", "--device", "cpu", "--quiet"]) == 2
    assert "num_heads (9) divisible by 2" in capsys.readouterr().err
    assert serve_main([*tiny, "--tp", "0"]) == 2
    assert "--tp must be at least 1" in capsys.readouterr().err


def test_a_float8_kv_cache_reaches_every_rank(tmp_path, capsys):
    """`--kv-cache-dtype fp8` builds the engine's cache in float8 on every tensor-parallel rank:
    two ranks give one rank's tokens, which are not the model-dtype cache's."""
    tiny = ["--model", "tiny", "--device", "cpu", "--quiet", "--num-requests", "6", "--output-len", "12,16"]
    runs = {"auto": [], "fp8": ["--kv-cache-dtype", "fp8"], "fp8 tp2": ["--kv-cache-dtype", "fp8", "--tp", "2"]}
    tokens = {}
    for name, extra in runs.items():
        path = tmp_path / f"{name}.json"
        assert serve_main([*tiny, *extra, "--json", str(path)]) == 0
        tokens[name] = {o["id"]: o["tokens"] for o in json.loads(path.read_text())["outputs"]}
    assert tokens["fp8 tp2"] == tokens["fp8"] != tokens["auto"]


def test_llama_1b_over_two_cpu_ranks_is_checked_for_every_rank_before_any_spawns(monkeypatch, capsys):
    """Both CPU ranks take their share of the same RAM: refused when one fits but two do not,
    accepted (it reaches the launcher, stubbed here: the 5 GB model is never built) when both fit."""
    from graphrelay.capture.model import memory_plan
    from graphrelay.capture.serving import cli

    launched = []

    def launcher(world, *args, **kwargs):
        launched.append(world)
        raise RuntimeError("stub launcher")

    monkeypatch.setattr(cli, "run_ranks", launcher)
    argv = ["--model", "llama-1b", "--tp", "2", "--device", "cpu", "--quiet", "--num-requests", "2",
            "--max-reqs", "16", "--max-batch", "16", "--max-tokens", "256", "--max-seq-len", "1024"]
    model = msgspec.structs.replace(ModelConfig.preset("llama-1b"), dtype="float32", max_seq_len=1024)  # as on a CPU
    rank = EngineConfig(model, max_reqs=16, max_batch=16, max_tokens=256).memory_plan(2).total
    monkeypatch.setattr(memory_plan, "free_bytes", lambda device: int(1.5 * rank))
    assert serve_main(argv) == 2
    err = capsys.readouterr().err
    assert "2 ranks x" in err and "GiB" in err and launched == []
    monkeypatch.setattr(memory_plan, "free_bytes", lambda device: 2 * rank + 1)
    assert serve_main(argv) == 2
    assert "stub launcher" in capsys.readouterr().err and launched == [2]


def test_ctrl_c_stops_every_tensor_parallel_rank():
    """Ctrl-C in the middle of a `--tp 2` run: the command exits 130 with one line, and no
    rank process outlives it (the parent terminates them; none is left blocked in gloo)."""
    cmd = [sys.executable, "-m", "graphrelay.tools.cli", "serve", "--tp", "2", "--model", "tiny", "--device", "cpu",
           "--num-requests", "5000", "--prompt-len", "4,8", "--output-len", "200,200"]
    # Ctrl-C's default action in the child whatever this test runs under: a shell that starts a
    # job in the background without job control (`nohup cmd &`) leaves SIGINT ignored, and an
    # ignored SIGINT would be inherited, so the run under test would never see it.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stderr:  # wait until the ranks are serving
        if "tensor parallel: spawning" in line:
            break
    time.sleep(6)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    # The parent alone (a terminal's Ctrl-C also reaches the ranks directly): it must stop them.
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=HANG_S) == 130
    assert "graphrelay serve: interrupted" in proc.stderr.read()
    deadline = time.time() + HANG_S
    while time.time() < deadline:
        states = subprocess.run(["ps", "-o", "stat=", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if all(state.startswith("Z") for state in states):  # zombies only: every rank has exited
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"rank processes still running after Ctrl-C: {states}")


TINY = ["--model", "tiny", "--device", "cpu", "--quiet"]


def test_a_top_k_the_engine_cannot_store_fails_before_any_work(tmp_path, capsys):
    """It used to fail mid-run ("cannot be converted to type int32"), losing what had finished."""
    path, out = tmp_path / "requests.jsonl", tmp_path / "out.json"
    path.write_text('{"prompt": [1, 2, 3], "max_new_tokens": 2}\n'
                    '{"id": "wide", "prompt": [1, 2], "max_new_tokens": 40, "sampling": {"temperature": 1.0, "top_k": 3000000000}}\n')
    assert serve_main([*TINY, "--requests", str(path), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "request 'wide': sampling top_k 3000000000" in err and "--max-top-k" in err and "Traceback" not in err
    assert serve_main([*TINY, "--requests", str(path), "--max-top-k", "4000000000"]) == 2
    assert "does not fit the engine's int32 top-k column" in capsys.readouterr().err
    assert serve_main([*TINY, "--top-k", "3000000000"]) == 2
    assert "--top-k 3000000000 is above --max-top-k 64" in capsys.readouterr().err
    assert not out.exists()


def test_a_run_that_fails_part_way_keeps_what_finished(tmp_path, capsys, monkeypatch):
    """Whatever the up-front checks miss: finished outputs are written, the rest are named."""
    from graphrelay.capture.iteration.engine import Engine

    path, out = tmp_path / "requests.jsonl", tmp_path / "out.json"
    path.write_text('{"id": "short", "prompt": [1, 2], "max_new_tokens": 2}\n'
                    '{"id": "long", "prompt": [3, 4], "max_new_tokens": 60}\n')
    launch = Engine.launch

    def failing_launch(self, spans, before_replay=None):
        if self.iterations_launched == 10:
            raise RuntimeError("device lost")
        return launch(self, spans, before_replay)

    monkeypatch.setattr(Engine, "launch", failing_launch)
    assert serve_main([*TINY, "--requests", str(path), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "failed part-way (RuntimeError: device lost); 1 of 2 requests had finished" in err
    assert f"outputs are in {out}; unfinished: 'long'" in err
    report = json.loads(out.read_text())
    assert report["unfinished"] == ["long"] and "device lost" in report["error"]
    assert [(o["id"], len(o["tokens"])) for o in report["outputs"]] == [("short", 2)]


@pytest.mark.parametrize("args, message", [
    (["--requests", "FILE", "--temperature", "5"], "--temperature does not apply to this run, which serves the requests in"),
    (["--requests", "FILE", "--seed", "3"], "--seed does not apply"),
    (["--requests", "FILE", "--max-new-tokens", "9"], "--max-new-tokens does not apply"),
    (["--weights", "random", "--tokenizer", "--top-k", "50"], "--top-k does not apply to this run, which serves the built-in chat prompts"),
    (["--num-requests", "4", "--max-new-tokens", "9"], "--max-new-tokens does not apply to this run, which serves a synthetic workload"),
    (["--spec-k", "0"], "--spec-k sets up speculative decoding, which is off; add --spec ngram"),
    (["--spec-ngram", "2,2"], "--spec-ngram sets up speculative decoding, which is off"),
    (["--gguf", "/missing.gguf", "--weights", "random"], "--gguf PATH gives real weights, which --weights random leaves unused"),
    (["--engine-placement", "thread"], "--engine-placement places the HTTP server's engine; it goes with --port"),
])
def test_options_the_run_would_ignore_are_refused(tmp_path, capsys, args, message):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": [1, 2], "max_new_tokens": 2}\n')
    assert serve_main([*TINY, *[str(path) if a == "FILE" else a for a in args]]) == 2
    assert message in capsys.readouterr().err


def test_tp_that_does_not_split_the_preset_is_refused_before_the_model_loads(capsys, monkeypatch):
    import graphrelay.capture.serving.cli as cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert serve_main(["--tp", "2", "--device", "cpu", "--quiet"]) == 2
    assert "num_heads (9) divisible by 2" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--top-k", "3000000000"], "--top-k 3000000000 is above 2147483647, the most the engine stores; 0 = no cut"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    (["--top-p", "0"], "--top-p must be a float in (0, 1]"),
    (["--spec-k", "2"], "--spec-k sets up speculative decoding, which is off"),
])
def test_generate_names_the_flag_before_the_model_loads(capsys, monkeypatch, args, message):
    import graphrelay.capture.serving.cli as cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert generate_main(["Hi", *args]) == 2
    assert message in capsys.readouterr().err


def test_generate_refuses_an_empty_plain_prompt_by_name(capsys):
    assert generate_main(["", "--no-chat", "--model", "tiny", "--weights", "random", "--tokenizer", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "the prompt is empty (it encodes to no tokens)" in err and "request '0'" not in err
