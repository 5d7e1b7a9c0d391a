"""`graphrelay bench soak --url URL`: many concurrent streaming clients, some leaving mid-stream,
over several rounds: exact text, no leaked slots, flat resident memory (issue 20's soak target).

The workload is seeded: N text completions (windows of the bench's English text; a quarter
greedy, the rest sampled with their own seed; every fifth stops at a blank line). First a
reference pass asks each once without streaming, all at once. Then each round streams all N at
once, and a seeded fraction (different clients each round) closes its connection after 1-3
text chunks. Every stream that completes must equal its reference: text, finish reason and
usage (`soak_round.problems`). The reference runs at the same concurrency as the rounds, so
the batches its requests ran in look alike; the engine is exact across batch shapes only
where its kernels are (see the README's "Where the modes may differ"), and a mismatch's detail
(where the texts part) tells a numeric near-tie from a lost or foreign chunk.

After each round the soak polls /health until the server is idle: every request reported
finished by the engine, every slot free (relay and KV cache slots are the same slots), and
reads the server's resident memory (`rss_bytes`). Round 1 also warms allocators and caches,
so memory is judged from the last round against the one before: flat when it grew by at most
`max(2 MiB, 8 KiB per client)`. That is far below what a leak of per-request state (a prompt,
its tokens, a queue: kilobytes each) would add over one round, and above the allocator noise
of rounds that repeat the same requests. Exit 1 when a request failed, a stream mismatched or
a slot leaked; the memory verdict is reported as a target.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any, Optional

import httpx

from graphrelay.capture.serving.workloads import DEMO_QUESTIONS
from graphrelay.tools.bench import options, results
from graphrelay.tools.bench.serve import positive_float
from graphrelay.tools.bench.serve_http import CONNECT_TIMEOUT_S, pick_model
from graphrelay.tools.bench.soak_round import problems, reference_pass, streaming_pass
from graphrelay.tools.bench.spec import GROUNDED

COMMAND = "graphrelay bench soak"
JSON_NAME = "soak_bench.json"
FULL = dict(clients=512, disconnect=0.1, rounds=3, prompt_words=(8, 48), output_len=(16, 128))
SMOKE = dict(clients=16, disconnect=0.25, rounds=2, prompt_words=(4, 12), output_len=(4, 16))
RSS_FLOOR_BYTES, RSS_PER_CLIENT_BYTES = 2 << 20, 8 << 10
DETAILS_KEPT = 5  # mismatch details per round in the report


def build_parser():
    parser = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (graphrelay serve --port)")
    parser.add_argument("--clients", type=options.positive_int, default=None, help="concurrent streams per round (default 512)")
    parser.add_argument("--disconnect", type=_fraction, default=None,
                        help="fraction of each round's clients that close their stream mid-way (default 0.1)")
    parser.add_argument("--rounds", type=options.positive_int, default=None, help="streaming rounds (default 3)")
    parser.add_argument("--prompt-words", type=options.int_range, default=None, metavar="LOW,HIGH",
                        help="words per prompt, uniform (default 8,48)")
    parser.add_argument("--output-len", type=options.int_range, default=None, metavar="LOW,HIGH",
                        help="max_tokens per request, uniform (default 16,128)")
    parser.add_argument("--seed", type=int, default=0, help="workload and disconnect seed")
    parser.add_argument("--served-model", default=None, help="the model name to request (default: the first of /v1/models)")
    parser.add_argument("--timeout-s", type=positive_float, default=600.0, help="per-request timeout (default 600)")
    parser.add_argument("--idle-timeout-s", type=positive_float, default=120.0,
                        help="how long the server may take to become idle after a round (default 120)")
    options.add_output_options(parser, "16 clients, 25%% disconnecting, 2 rounds, short outputs: checks the code paths")
    return parser


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in [0, 1), e.g. 0.1")
    return value


def main(argv: list[str]) -> int:
    command = ["bench", "soak", *argv]
    try:
        args = options.parse(build_parser(), argv)
        if isinstance(args, int):
            return args
        if not args.url.startswith(("http://", "https://")):
            raise options.UsageError(f"--url {args.url!r} must start with http:// or https://")
        plan = {k: getattr(args, k) if getattr(args, k) is not None else v
                for k, v in (SMOKE if args.smoke else FULL).items()}
        plan.update(url=args.url.rstrip("/"), seed=args.seed, timeout_s=args.timeout_s, idle_timeout_s=args.idle_timeout_s)
        plan["model"] = pick_model(plan["url"], args.served_model)
    except options.UsageError as error:
        return options.report_usage_error(COMMAND, error)
    start = time.perf_counter()
    report = soak(plan)
    out = options.out_dir(args)
    report.update(benchmark="soak", smoke=args.smoke, environment=results.environment(_cpu(), command), plan=plan,
                  wall_s=time.perf_counter() - start)
    results.write_json(out / JSON_NAME, report)
    print(f"wrote {out / JSON_NAME}")
    print(format_rounds(report["rounds"]))
    for target in report["targets"]:
        print(results.Target(**{k: target[k] for k in ("name", "limit", "unit", "at_most", "measured")}).line())
    print(f"{COMMAND}: memory {report['memory_verdict']}; "
          + ("every completed stream exact, no slot leaked" if report["correct"] else "FAILED: see the rounds above"))
    return 0 if report["correct"] else 1


def _cpu():
    import torch  # results.environment names the device the figures came from: this client's

    return torch.device("cpu")


def requests(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The seeded request bodies (non-streaming; the rounds add the stream flags)."""
    rng = random.Random(f"soak-{plan['seed']}")
    words = " ".join([*(passage for _, passage in GROUNDED), *DEMO_QUESTIONS]).split()
    bodies = []
    for i in range(plan["clients"]):
        n = rng.randint(*plan["prompt_words"])
        first = rng.randrange(len(words) - n)
        body = {"model": plan["model"], "prompt": " ".join(words[first:first + n]),
                "max_tokens": rng.randint(*plan["output_len"]), "seed": rng.randrange(1 << 31)}
        body.update({"temperature": 0.0} if i % 4 == 0 else {"temperature": 0.9, "top_p": 0.95})
        if i % 5 == 0:
            body["stop"] = ["\n\n"]
        bodies.append(body)
    return bodies


def leavers(plan: dict[str, Any], round_no: int) -> dict[int, int]:
    """This round's disconnecting clients: index -> text chunks after which it leaves."""
    rng = random.Random(f"soak-{plan['seed']}-round-{round_no}")
    chosen = rng.sample(range(plan["clients"]), round(plan["disconnect"] * plan["clients"]))
    return {i: rng.randint(1, 3) for i in sorted(chosen)}


def soak(plan: dict[str, Any]) -> dict[str, Any]:
    bodies = requests(plan)
    say(f"{plan['clients']} clients x {plan['rounds']} rounds against {plan['url']} (model {plan['model']}), "
        f"{plan['disconnect']:.0%} disconnecting; reference pass first")
    before = wait_idle(plan)
    references = reference_pass(plan["url"], bodies, plan["timeout_s"])
    failed_refs = [(i, r.error) for i, r in enumerate(references) if r.error is not None]
    state = wait_idle(plan)
    rounds = []
    for round_no in range(1, plan["rounds"] + 1):
        leave = leavers(plan, round_no)
        answers = streaming_pass(plan["url"], bodies, leave, plan["timeout_s"])
        after = wait_idle(plan)
        rounds.append(round_figures(round_no, bodies, references, answers, leave, state, after))
        state = after
        say(round_line(rounds[-1]))
    rss = [r["rss_mib"] for r in rounds]
    tolerance = max(RSS_FLOOR_BYTES, RSS_PER_CLIENT_BYTES * plan["clients"]) / 2**20
    growth = rss[-1] - rss[-2] if len(rss) >= 2 and None not in rss[-2:] else None
    verdict = "not measured" if growth is None else ("flat" if growth <= tolerance else "GROWING")
    mismatches = sum(r["mismatches"] for r in rounds)
    leaked = sum(r["slots_leaked"] + r["requests_leaked"] for r in rounds)
    errors = len(failed_refs) + sum(r["errors"] for r in rounds)
    targets = [
        results.Target("exact-text mismatches, all rounds", 0, "requests", True, mismatches),
        results.Target("slots and requests leaked, all rounds", 0, "", True, leaked),
        results.Target(f"resident memory growth, round {len(rss) - 1} to {len(rss)}", tolerance, "MiB", True, growth),
    ]
    return {"reference": {"requests": len(bodies), "errors": len(failed_refs), "first_error": failed_refs[0] if failed_refs else None,
                          "rss_mib_before": _mib(before.get("rss_bytes"))},
            "rounds": rounds, "rss_tolerance_mib": tolerance, "rss_growth_mib": growth, "memory_verdict": verdict,
            "targets": [t.as_dict() for t in targets], "correct": mismatches == leaked == errors == 0}


def round_figures(round_no, bodies, references, answers, leave, before, after) -> dict[str, Any]:
    completed, details, errors = [], [], []
    for i, (body, ref, got) in enumerate(zip(bodies, references, answers)):
        if got.error is not None:
            errors.append(f"request {i}: {got.error}")
        elif not got.disconnected and ref.error is None:
            completed.append(i)
            found = problems(got, ref, body["max_tokens"])
            if found:
                details.append({"request": i, "problems": found})
    engine_finished = sum(after["finished"].values()) - sum(before["finished"].values())
    return {
        "round": round_no, "clients": len(bodies), "planned_disconnects": len(leave),
        "disconnected": sum(a.disconnected for a in answers), "completed": len(completed),
        "mismatches": len(details), "mismatch_details": details[:DETAILS_KEPT],
        "errors": len(errors), "first_error": errors[0] if errors else None,
        "engine_finished": engine_finished,  # every request of the round, disconnected ones included
        "slots_leaked": after["slots"] - after["free_slots"],
        "requests_leaked": after["outstanding"],  # submitted, never reported finished
        "idle": after["idle"], "health": {k: v for k, v in after.items() if k != "idle"},
        "rss_mib": _mib(after.get("rss_bytes")),
    }


def wait_idle(plan: dict[str, Any]) -> dict[str, Any]:
    """/health once nothing is outstanding and every slot is free, or its last answer when the
    idle timeout passes first (`idle` says which)."""
    deadline = time.monotonic() + plan["idle_timeout_s"]
    while True:
        state = httpx.get(f"{plan['url']}/health", timeout=CONNECT_TIMEOUT_S).json()
        idle = (state["outstanding"] == 0 and state["free_slots"] == state["slots"]
                and state["running"] == state["retiring"] == state["waiting"] == 0)
        if idle or time.monotonic() > deadline:
            return {**state, "idle": idle}
        time.sleep(0.1)


def _mib(value: Optional[int]) -> Optional[float]:
    return None if value is None else value / 2**20


def round_line(r: dict[str, Any]) -> str:
    rss = "n/a" if r["rss_mib"] is None else f"{r['rss_mib']:.1f} MiB"
    return (f"round {r['round']}: {r['completed']} completed, {r['disconnected']} disconnected, {r['mismatches']} "
            f"mismatches, {r['errors']} errors, {r['slots_leaked']} slots and {r['requests_leaked']} requests leaked, "
            f"RSS {rss}")


def format_rounds(rounds: list[dict[str, Any]]) -> str:
    headers = ["round", "completed", "disconnected", "mismatches", "errors", "slots leaked", "requests leaked", "RSS MiB"]
    body = [[str(r["round"]), str(r["completed"]), str(r["disconnected"]), str(r["mismatches"]), str(r["errors"]),
             str(r["slots_leaked"]), str(r["requests_leaked"]), "n/a" if r["rss_mib"] is None else f"{r['rss_mib']:.1f}"]
            for r in rounds]
    return results.format_table(headers, body)


def say(text: str) -> None:
    print(f"{COMMAND}: {text}", flush=True)
