"""`graphrelay bench controls`: what the sampling controls cost inside the captured decode step.

One engine per variant, all at one batch size B (64; the model's shapes with random weights:
the cost does not depend on the weights), every slot prefilled, then the decode step's graph
(the step variant the engine picks for that batch, as `Engine.launch` does) replayed back to
back and timed with CUDA events. Variants:

- off: no controls in the engine (EngineConfig.controls None): the baseline;
- idle: an engine with controls and logprobs, no request using any: its batches replay the
  plain graph, so this is what the controls cost a batch that does not use them (~ off);
- idle-no-logprobs: the same without the logprob ops (ControlsConfig.logprobs False);
- penalties, bias+min_tokens, grammar (a regex over a made-up vocabulary), logprobs (the
  top 20, the most a request may ask), all (every control but min_tokens, which a grammar
  excludes): every request using them, so the controls graph.

Reported: µs per step (median of repeats) and the overhead over `off`; the target (issue 21:
each control <= 5% while in use) is reported per control, not asserted; `all` (every control
at once) is reported beside it without a target.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import torch

from graphrelay.capture.iteration.controls.grammar import GrammarCompiler, made_up_token_strings, vocabulary
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig
from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.spans import decode_span, prefill_span
from graphrelay.capture.iteration.step import CONTROLS, PLAIN
from graphrelay.capture.model.model import ModelConfig
from graphrelay.tools.bench import options, results
from graphrelay.tools.bench.timing import Clock, time_eager

COMMAND = "graphrelay bench controls"
JSON_NAME = "controls_bench.json"
PROMPT_LEN = 8
OVERHEAD_LIMIT = 5.0  # percent of the decode step, per control in use
REGEX = r"[a-z ]{1,200}\."
VARIANTS: dict[str, tuple[ControlsConfig | None, ControlParams | None]] = {
    "off": (None, None),
    "idle": (ControlsConfig(), None),
    "idle-no-logprobs": (ControlsConfig(logprobs=False), None),
    "penalties": (ControlsConfig(), ControlParams(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.2)),
    "bias+min_tokens": (ControlsConfig(), ControlParams(logit_bias={i: 1.0 for i in range(1, 17)}, min_tokens=1000)),
    "grammar": (ControlsConfig(), ControlParams(regex=REGEX)),
    "logprobs": (ControlsConfig(), ControlParams(logprobs=20)),
    "all": (ControlsConfig(), ControlParams(frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 1.0},
                                             logprobs=20, regex=REGEX)),
}


def build_parser() -> argparse.ArgumentParser:
    p = options.OneLineParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    options.add_common_options(p, default_iters=50, default_repeats=5)
    p.add_argument("--batch", type=options.positive_int, default=64, help="decode batch size (default 64)")
    p.add_argument("--model", default="smollm2-135m", help="model preset whose shapes are timed (default smollm2-135m)")
    return p


def main(argv: list[str]) -> int:
    try:
        args = options.parse(build_parser(), argv)
        if isinstance(args, int):
            return args
        device = options.pick_device(args.smoke, COMMAND)
        if args.smoke:
            args.model, args.batch, args.iters, args.repeats = "tiny", 2, 2, 1
        model = ModelConfig.preset(args.model)
    except (options.UsageError, ValueError) as error:
        return options.report_usage_error(COMMAND, options.UsageError(str(error)))
    steps = decode_steps(args)
    model = msgspec.structs.replace(model, max_seq_len=PROMPT_LEN + steps + 8)
    rows = {name: time_variant(model, device, args, *variant) for name, variant in VARIANTS.items()}
    base = rows["off"]["step_us"]
    for row in rows.values():
        row["overhead_percent"] = 100.0 * (row["step_us"] - base) / base
    targets = [results.Target(f"{name} overhead at batch {args.batch}", OVERHEAD_LIMIT, "%", True,
                              None if args.smoke else row["overhead_percent"])
               for name, row in rows.items() if name not in ("off", "idle-no-logprobs", "all")]
    print(results.format_table(["variant", "µs/step", "overhead %"],
                               [[n, f"{r['step_us']:.1f}", f"{r['overhead_percent']:+.1f}"] for n, r in rows.items()]))
    for target in targets:
        print(target.line())
    out = Path(options.out_dir(args)) / JSON_NAME
    results.write_json(out, {"benchmark": "controls", "smoke": args.smoke, "model": args.model, "batch": args.batch,
                             "environment": results.environment(device, ["bench", "controls", *argv]),
                             "rows": rows, "targets": [t.as_dict() for t in targets]})
    print(f"wrote {out}")
    return 0


def decode_steps(args) -> int:
    """Decode steps one variant runs: timed loops plus the eager warm-up."""
    return args.iters * args.repeats + 3


def time_variant(model: ModelConfig, device: torch.device, args, controls: ControlsConfig | None,
                 params: ControlParams | None) -> dict:
    batch = args.batch
    engine = Engine(EngineConfig(model, max_reqs=batch, max_batch=batch, device=str(device),
                                 use_graphs=device.type == "cuda", controls=controls))
    if engine.controls is not None:
        engine.controls.set_compiler(GrammarCompiler(vocabulary(made_up_token_strings(model.vocab_size), 0),
                                                     model.vocab_size))
    engine.capture()
    slots = list(range(1, batch + 1))
    prompt = [(7 * i) % model.vocab_size for i in range(1, PROMPT_LEN + 1)]
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=1)
    with engine.activate():
        if engine.controls is not None:
            for slot in slots:
                engine.admit_controls(slot, params, (0,), prompt)
        engine.launch([prefill_span(slot, sampling, prompt, 0, True) for slot in slots])
        # The decode iteration of the whole batch, replayed in place (its bucket is the batch).
        decodes = [decode_span(slot, sampling) for slot in slots]
        variant = engine.variant(decodes)
        if variant != (PLAIN if params is None else CONTROLS):
            raise RuntimeError(f"the engine picked the {variant} step for a batch with controls {params}")
        engine.inputs.load(decodes, batch, 1, engine.torch_stream)
        sample = time_eager(Clock(device), lambda _k: engine.runner.run(batch, variant), args.iters, args.repeats)
    return {"step_us": sample.median_us, "min_us": sample.min_us, "max_us": sample.max_us,
            "controls_bytes": engine.controls.nbytes if engine.controls is not None else 0}
