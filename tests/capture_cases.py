"""Shared builders for capture-layer tests: an iteration stack (an `Engine`'s relay, tiny model,
host mirror, static inputs, IterationStep, GraphRunner), a scheduler-like driver, batch-composition
schedules, and state comparisons whose failure messages say what differed and where.

CPU and GPU tests drive the same code, so the GPU suite exercises exactly the flow the CPU
tests check against the slow reference model.
"""

from __future__ import annotations

import gc
import random
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch

from graphrelay.capture.iteration.engine import Engine, EngineConfig
from graphrelay.capture.iteration.graph_runner import WARMUP_RUNS, GraphRunner
from graphrelay.capture.model.linear_plan import LinearPlan
from graphrelay.capture.model.model import LlamaModel, ModelConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.inputs import IterationInputs
from graphrelay.capture.iteration.spans import Span, decode_span, prefill_span
from graphrelay.capture.iteration.step import IterationStep
from graphrelay import Relay, RelayConfig
from graphrelay.mirror import HostMirror, MirrorRead
from relay_cases import bits

MODEL = ModelConfig.preset("tiny")  # vocab 512, 2 layers, max_seq_len 256: fast on CPU and GPU
GREEDY = SamplingParams()
# Seeded temperature / top-k rows exercise the sampler's Gumbel path under capture.
SAMPLED = (SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.3, top_k=20, seed=-5))


# ---- the stack ------------------------------------------------------------------------------


@dataclass
class Stack:
    """Everything one iteration touches, from an `Engine`."""

    relay: Relay
    model: LlamaModel
    mirror: HostMirror
    inputs: IterationInputs
    step: IterationStep
    runner: GraphRunner
    stream: object  # what mirror.record takes: the current torch stream on CUDA, 0 on the CPU
    engine: Engine  # the builder; the tests drive its parts directly
    addresses: dict[str, int] = field(default_factory=dict)  # static buffers at build time

    @property
    def config(self) -> RelayConfig:
        return self.relay.config


def build_stack(
    device,
    *,
    max_reqs: int = 24,
    max_batch: int = 16,
    max_tokens: int = 64,
    buckets: Optional[Sequence[int]] = None,
    use_graphs: bool = True,
    depth: int = 3,
    plan: Optional[LinearPlan] = None,
    max_top_k: Optional[int] = None,
) -> Stack:
    """A stack, warmed up (and captured when `use_graphs` on CUDA), mirror reset to iteration 0.

    plan: the projection backends (None: measured on the GPU, as serving does); twins compared
    bit for bit pass the same plan. Eager stacks run the runner's warm-up too, so their padding scratch rows (KV row 0) hold
    what a captured twin's hold, and whole-state comparisons stay bit-exact."""
    device = torch.device(device)
    # Built by the engine, as serving builds it (relay without host-side value checks, which
    # sync; the scheduler validates slots where it assigns them). The tests drive its parts.
    engine = Engine(EngineConfig(MODEL, max_reqs=max_reqs, max_batch=max_batch, device=str(device),
                                 use_graphs=use_graphs, buckets=tuple(buckets) if buckets else None,
                                 max_top_k=max_top_k, mirror_depth=depth, max_tokens=max_tokens))
    runner = engine.runner
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else 0
    stack = Stack(engine.relay, engine.model, engine.mirror, engine.inputs, engine.step, runner, stream, engine)
    stack.addresses = static_addresses(stack)
    if not runner.use_graphs:
        # The runner's warm-up, eagerly: all-padding inputs (IterationInputs starts zeroed).
        for bs in sorted(runner.buckets, reverse=True):
            for _ in range(WARMUP_RUNS):
                stack.step(bs)
    engine.capture(plan)  # graphs (if any), and the mirror back at iteration 0
    return stack


def close_stack(stack: Stack) -> None:
    """Drop the graphs before the mirror's ring (they hold its address), then free the ring."""
    if stack.relay.device.type == "cuda":
        torch.cuda.synchronize(stack.relay.device)
    stack.runner.graphs.clear()
    stack.mirror.close()


def static_addresses(stack: Stack) -> dict[str, int]:
    """data_ptr of every buffer a captured step reads or writes: graphs bake these in, so any
    move means a replay reads or writes freed memory."""
    out = {f"inputs.{name}": t.data_ptr() for name, t in zip(stack.inputs.buffers._fields, stack.inputs.buffers)}
    out.update({f"relay.{name}": t.data_ptr() for name, t in stack.relay.buffers.items()})
    out["relay.generation"] = stack.relay.generation.data_ptr()
    for name, t in stack.step.prologue.buffers._asdict().items():
        if t is not None:
            out[f"step.prologue.{name}"] = t.data_ptr()
    for name in ("logits", "target"):
        out[f"step.{name}"] = getattr(stack.step, name).data_ptr()
    cache = stack.model.kv_cache
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        out[f"kv.keys[{layer}]"] = k.data_ptr()
        out[f"kv.values[{layer}]"] = v.data_ptr()
    return out


# ---- driving it like a scheduler ------------------------------------------------------------


class Driver:
    """Plays a scheduler over one stack: requests join (their whole prompt rides in the next
    launch as a prefill span, which samples the first token), leave, and every launch runs
    the decode spans of a batch of slots in a given order beside the joining prompts."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.params: dict[int, SamplingParams] = {}
        self.joining: list[Span] = []
        self.iteration = 0  # next iteration to launch

    def join(self, slot: int, prompt: Sequence[int], params: SamplingParams = GREEDY) -> None:
        """Admit `slot` for a new request; its prompt is prefilled by the next launch."""
        self.stack.relay.admit([slot])
        self.joining.append(prefill_span(slot, params, list(prompt), 0, True))
        self.params[slot] = params

    def leave(self, slot: int) -> None:
        del self.params[slot]

    def spans(self, slots: Sequence[int]) -> list[Span]:
        return [decode_span(slot, self.params[slot]) for slot in slots] + self.joining

    def launch(self, slots: Sequence[int]) -> int:
        """Lay out `slots`' decode spans and the joining prompts in their token bucket and run
        one iteration; records it. Returns the bucket it ran at."""
        s = self.stack
        spans = self.spans(slots)
        self.joining = []
        tokens = s.engine.check_spans(spans) if spans else 0
        bucket = s.runner.bucket(max(tokens, 1))
        s.inputs.load(spans, bucket, s.engine.config.tokens_per_decode)
        ran = s.runner.run(bucket)
        assert ran == bucket, f"runner ran {ran} tokens for an iteration of {tokens}, expected bucket {bucket}"
        s.mirror.record(self.iteration, s.stream)
        self.iteration += 1
        return ran

    def apply(self, plan: "StepPlan") -> int:
        """One scheduler iteration: leaves, joins, then the launch."""
        for slot in plan.leave:
            self.leave(slot)
        for slot, prompt, params in plan.join:
            self.join(slot, prompt, params)
        return self.launch(plan.batch)

    def read(self, iteration: int) -> MirrorRead:
        return self.stack.mirror.wait(iteration)


# ---- schedules ------------------------------------------------------------------------------


class StepPlan(NamedTuple):
    leave: list[int]  # slots whose requests finished before this step
    join: list[tuple[int, list[int], SamplingParams]]  # (slot, prompt, params) prefilled in it
    batch: list[int]  # slots decoded this step, in batch order (running requests may sit out)


def composition_schedule(
    steps: int, max_reqs: int, max_batch: int, *, seed: int, sampled: bool = True, vocab: int = MODEL.vocab_size,
) -> list[StepPlan]:
    """A schedule whose batch composition changes every step: requests join and leave, freed
    slots are reused (so generations bump), the batch is a shuffled subset of the running
    requests, and batch sizes cycle through 1..max_batch (so every bucket and many padding
    amounts occur). One step in the middle is an empty batch: a bucket of pure padding. Joining
    prompts ride in the same iteration as the decodes of the requests already running.

    Prompts are at most 12 tokens, so a request stays far below max_seq_len over 64 steps."""
    rng = random.Random(seed)
    sizes: list[int] = []
    while len(sizes) < steps:
        cycle = list(range(1, max_batch + 1))
        rng.shuffle(cycle)
        sizes += cycle
    sizes[steps // 2] = 0
    running: list[int] = []
    free = list(range(1, max_reqs + 1))
    rng.shuffle(free)
    plans = []
    for t in range(steps):
        target = sizes[t]
        leave = rng.sample(running, rng.randint(0, min(3, len(running))))
        for slot in leave:
            running.remove(slot)
        batch = rng.sample(running, min(target, len(running)))
        joins = []
        want = max(target - len(running), rng.randint(0, 2))
        for _ in range(min(want, len(free))):
            # Freed slots go to the back of the queue half the time and straight back into
            # use the other half: immediate reuse is where stale rows would show.
            slot = free.pop(0 if rng.random() < 0.5 else -1)
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            params = rng.choice((GREEDY,) + SAMPLED) if sampled else GREEDY
            joins.append((slot, prompt, params))
            running.append(slot)
        free += leave
        plans.append(StepPlan(leave, joins, batch))
    return plans


# ---- GPU helpers ----------------------------------------------------------------------------


@contextmanager
def sync_debug_error():
    """Any host sync torch sees inside raises RuntimeError (what capture would forbid)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextmanager
def gc_paused():
    """Collect now, then keep Python's cyclic GC off: a collection mid-loop could free CUDA
    tensors left in reference cycles by earlier tests and make memory_allocated() move for
    reasons unrelated to the replays being measured."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# ---- comparisons ----------------------------------------------------------------------------


def step_state(stack: Stack, bs: int) -> dict[str, torch.Tensor]:
    """Clones of everything a step writes: relay rows, generations, KV caches (dim 0 = slot 1..),
    and the step's static outputs for token bucket `bs` (dim 0 = span or sampled row)."""
    state = {f"relay.{name}[slot]": t.clone() for name, t in stack.relay.buffers.items()}
    state["relay.generation[slot]"] = stack.relay.generation.clone()
    cache = stack.model.kv_cache
    # Row 0 is the padding slot's scratch: padding tokens write there whatever their hidden
    # state holds (the attention leaves tokens outside every query block unwritten), which
    # differs between a graph's memory and eager's and is never read by a real token.
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        state[f"kv.keys[{layer}][slot]"] = k[1:].clone()
        state[f"kv.values[{layer}][slot]"] = v[1:].clone()
    placed = stack.step.prologue.buffers.narrow(stack.inputs.geometry(bs))
    for name in ("seq_lens", "base", "positions", "slots", "row_positions"):
        state[f"step.prologue.{name}[row]"] = getattr(placed, name).clone()
    rows = stack.inputs.geometry(bs).rows
    for name in ("logits", "target"):
        state[f"step.{name}[row]"] = getattr(stack.step, name)[:rows].clone()
    state["inputs.span_slot[row]"] = stack.inputs.buffers.span_slot[:rows].clone()
    return state


def state_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Bit-level differences, one line per tensor: its name, the first differing index along
    dim 0 (a slot or a batch row, as the name says) and both values there."""
    assert a.keys() == b.keys(), f"state keys differ: {sorted(a.keys() ^ b.keys())}"
    lines = []
    for name in a:
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            lines.append(f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
            continue
        if torch.equal(bits(x), bits(y)):
            continue
        rows = (bits(x.reshape(x.shape[0], -1)).view(x.shape[0], -1) != bits(y.reshape(y.shape[0], -1)).view(y.shape[0], -1))
        first = int(rows.any(dim=1).nonzero()[0])
        count = int(rows.any(dim=1).sum())
        lines.append(f"{name}: {count} rows differ, first at index {first}: "
                     f"{_short(x[first])} vs {_short(y[first])}")
    return lines


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], context: str) -> None:
    diffs = state_differences(a, b)
    assert not diffs, f"{context}: graph and eager differ:\n  " + "\n  ".join(diffs)


def assert_same_read(a: MirrorRead, b: MirrorRead, context: str) -> None:
    """Two mirror reads of the same iteration agree on every row field, bit for bit."""
    assert a.iteration == b.iteration, f"{context}: iterations {a.iteration} vs {b.iteration}"
    for name in ("slots", "generation", "tokens", "seq_lens", "stale"):
        x, y = getattr(a, name), getattr(b, name)
        if x.shape != y.shape or not torch.equal(x, y):
            raise AssertionError(
                f"{context}: mirror {name} differ for iteration {a.iteration}: "
                f"{x.tolist()} vs {y.tolist()} (slots {a.slots.tolist()} vs {b.slots.tolist()})")


def assert_same_addresses(before: dict[str, int], after: dict[str, int], context: str) -> None:
    moved = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    assert not moved, f"{context}: static buffers moved (a replay would use the old address): {moved}"


def _short(t: torch.Tensor) -> str:
    flat = t.reshape(-1)
    text = flat[:6].tolist()
    return f"{text}{'...' if flat.numel() > 6 else ''}"
