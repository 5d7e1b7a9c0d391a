"""The whole unified iteration captured per token bucket: relay resolve -> tiny Llama forward over
decode spans and prompt chunks -> sampling -> relay stash + publish -> host-mirror write, one CUDA
graph per bucket, against a twin stack built identically that runs the same padded step eagerly.

Every comparison is bit for bit, over the relay rows, the KV cache, the step's static outputs
and what the host mirror's consumer reads; a failure names the bucket or step, the tensor, and
the first slot or batch row that differs.
"""

from __future__ import annotations

import random

import pytest
import torch

from graphrelay.capture.iteration.buckets import default_buckets
from graphrelay.capture.iteration.graph_runner import GraphRunner
from graphrelay.capture.iteration.spans import decode_span
from graphrelay.capture.model.linear_plan import LinearPlan
from capture_cases import (
    GREEDY,
    SAMPLED,
    Driver,
    assert_same_addresses,
    assert_same_read,
    assert_same_state,
    build_stack,
    close_stack,
    composition_schedule,
    gc_paused,
    static_addresses,
    step_state,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
MAX_REQS, MAX_BATCH, MAX_TOKENS = 24, 16, 256  # 16 decodes + 16 joining 12-token prompts fit
BUCKETS = default_buckets(MAX_TOKENS)  # 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ..., 256
STEPS = 64
LAG = 2  # read iteration N - 2 after launching N, like an overlap loop (mirror depth 3)
REPLAYS = 1000
SLEEP_CYCLES = 50_000_000  # ~25 ms of GPU time: the host polls long before the write lands


def build_pair(**kwargs) -> tuple[Driver, Driver]:
    """(graph, eager) drivers over stacks built identically; only use_graphs differs (the eager
    twin takes the plan the graph twin measured: where backends tie, timing noise decides)."""
    sizes = dict(max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS)
    graph = Driver(build_stack(DEVICE, use_graphs=True, **sizes, **kwargs))
    return graph, Driver(build_stack(DEVICE, use_graphs=False, plan=graph.stack.model.plan, **sizes, **kwargs))


@pytest.fixture
def twins():
    pair = build_pair()
    yield pair
    for driver in pair:
        close_stack(driver.stack)


def join_all(drivers, slots, seed: int) -> None:
    """The same requests (random prompts, greedy and seeded-sampling params) in every driver,
    prefilled by iterations of their own."""
    rng = random.Random(seed)
    slots = list(slots)
    for group in range(0, len(slots), MAX_BATCH):  # an iteration holds at most MAX_BATCH spans
        for slot in slots[group: group + MAX_BATCH]:
            prompt = [rng.randrange(512) for _ in range(rng.randint(1, 10))]
            params = rng.choice((GREEDY,) + SAMPLED)
            for driver in drivers:
                driver.join(slot, prompt, params)
        for driver in drivers:
            driver.launch([])


def launch_both(graph: Driver, eager: Driver, slots, context: str) -> int:
    sizes = [d.launch(slots) for d in (graph, eager)]
    assert sizes[0] == sizes[1], f"{context}: graph ran {sizes[0]} rows, eager {sizes[1]}"
    return sizes[0]


def test_capture_every_bucket_under_sync_debug(twins):
    """Every bucket captured (default global mode) after warm-ups that ran under sync-debug
    "error", and the mode is restored. If this failed, the engine would have no graph for some
    batch sizes, or its step hides a host sync that stalls every iteration."""
    graph, _ = twins
    assert graph.stack.runner.sync_debug, "the stack must warm up under sync-debug 'error'"
    assert sorted(graph.stack.runner.graphs) == BUCKETS
    assert graph.stack.runner.report.seconds > 0
    assert torch.cuda.get_sync_debug_mode() == 0, "capture left sync-debug mode on"

    # The warm-up check has teeth: a step with a host sync fails before capture starts.
    probe = torch.zeros(4, device=DEVICE)

    def syncing_step(bs: int) -> None:
        probe[:bs].add_(float(probe[:bs].sum().item()))

    runner = GraphRunner(syncing_step, [1, 4], 4, DEVICE)
    with pytest.raises(RuntimeError, match="synchroniz"):
        runner.capture()
    assert runner.graphs == {} and torch.cuda.get_sync_debug_mode() == 0


def test_node_count_is_read_from_the_captured_graph(twins):
    """The report's node counts come from the graphs themselves: a step of exactly three
    kernels captures three nodes per bucket, and the real step's graphs are non-trivial."""
    x = torch.zeros(8, device=DEVICE)
    y = torch.zeros(8, device=DEVICE)

    def three_kernels(bs: int) -> None:
        x[:bs].add_(1)
        y[:bs].mul_(2)
        y[:bs].add_(x[:bs])

    runner = GraphRunner(three_kernels, [2, 8], 8, DEVICE)
    assert runner.capture().nodes == {2: 3, 8: 3}
    graph, _ = twins
    assert set(graph.stack.runner.report.nodes) == set(BUCKETS)
    assert all(n > 3 for n in graph.stack.runner.report.nodes.values())


def test_every_bucket_replay_equals_eager(twins):
    """For every token bucket, full and with padding, twice in a row (the second iteration
    consumes what the first stashed): decode spans of running requests plus, above 16 tokens,
    a prompt of a re-joining request filling the bucket. The replay leaves relay rows, KV
    cache, step outputs and the mirror read bit-identical to the eager step on the same padded
    inputs. If this failed, turning CUDA graphs on would change what an engine generates."""
    graph, eager = twins
    decoding = list(range(1, MAX_BATCH + 1))
    join_all(twins, decoding, seed=1)
    rng = random.Random(2)
    previous = 0
    for bucket in BUCKETS:
        for tokens in sorted({bucket, previous + 1}, reverse=True):
            for repeat in range(2):
                # Up to MAX_BATCH decode spans; a bigger bucket keeps one span for the prompt.
                n = tokens if tokens <= MAX_BATCH else MAX_BATCH - 1
                slots = rng.sample(decoding, n)
                if tokens > n:  # a fresh request's prompt fills the rest of the bucket
                    prompt = [rng.randrange(512) for _ in range(tokens - n)]
                    for driver in twins:
                        driver.join(MAX_REQS - repeat, prompt)
                context = f"bucket {bucket}, {tokens} tokens (repeat {repeat}), decode slots {slots}"
                assert launch_both(graph, eager, slots, context) == bucket, context
                assert_same_state(step_state(graph.stack, bucket), step_state(eager.stack, bucket), context)
                iteration = graph.iteration - 1
                assert_same_read(graph.read(iteration), eager.read(iteration), context)
                for slot in slots:  # keep the decoding requests far from max_seq_len
                    for driver in twins:
                        driver.stack.relay.publish(torch.tensor([slot], device=DEVICE),
                                                   torch.tensor([12], dtype=torch.int32, device=DEVICE))
        previous = bucket


def test_changing_batches_64_steps_graph_equals_eager(twins):
    """64 steps whose batch composition changes every step (requests join with their prompt in
    the same iteration as the running decodes and leave, freed slots are reused, the batch is a shuffled subset, padding changes, one
    step is empty): graph and eager agree bit for bit after every step, and the mirror reads,
    polled at lag 2 as an overlap loop does, give the same tokens, seq lens, generations and
    stale flags. Static buffer addresses never change. If this failed, a serving engine with
    graphs would drift from eager under real traffic: wrong tokens after a slot is reused, a
    request picking up another's row, or a graph replaying over moved buffers."""
    graph, eager = twins
    polled = 0
    for t, plan in enumerate(composition_schedule(STEPS, MAX_REQS, MAX_BATCH, seed=1)):
        context = f"step {t}, batch slots {plan.batch}, joined {[j[0] for j in plan.join]}, left {plan.leave}"
        sizes = [d.apply(plan) for d in (graph, eager)]
        assert sizes[0] == sizes[1], f"{context}: graph ran {sizes[0]} rows, eager {sizes[1]}"
        assert_same_state(step_state(graph.stack, sizes[0]), step_state(eager.stack, sizes[0]), context)
        if t >= LAG:
            # Never block when the iteration is done; wait only if it is not (the ring keeps
            # just `depth` iterations, so the reader must not fall further behind).
            got = graph.stack.mirror.poll(t - LAG)
            polled += got is not None
            assert_same_read(got if got is not None else graph.read(t - LAG), eager.read(t - LAG), f"step {t - LAG} read at step {t}")
    for t in range(STEPS - LAG, STEPS):
        assert_same_read(graph.read(t), eager.read(t), f"step {t} (drained)")
    assert polled > 0, "poll never returned a finished iteration"
    assert_same_addresses(graph.stack.addresses, static_addresses(graph.stack), "after 64 steps")


def test_padding_does_not_change_real_results():
    """The same requests through stacks that pad differently: one with the default token
    buckets (little padding) and one with a single bucket of 256 (up to 255 padding tokens),
    both captured. Tokens, seq lens and generations agree every step, and so do the relay rows
    of every request. If this failed, a request's output would depend on how many others share
    its iteration, i.e. on load."""
    sizes = dict(max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS)
    # One backend for every row count: padding changes a projection's row count, and with it
    # a measured plan's backend (whose rounding differs), which is not what this test is about.
    plan = LinearPlan.fixed("torch")
    exact = Driver(build_stack(DEVICE, plan=plan, **sizes))
    padded = Driver(build_stack(DEVICE, buckets=[MAX_TOKENS], plan=plan, **sizes))
    try:
        for t, plan in enumerate(composition_schedule(24, MAX_REQS, MAX_BATCH, seed=4)):
            sizes = [d.apply(plan) for d in (exact, padded)]
            assert sizes[1] == MAX_TOKENS and sizes[0] <= MAX_TOKENS
            a, b = exact.read(t), padded.read(t)
            n = len(a)
            # Different bucket sizes may pick different GEMM kernels, so logits agree closely,
            # not bitwise; shown only to explain a token mismatch (a near-tie) if one occurs.
            gap = (exact.stack.step.logits[:n] - padded.stack.step.logits[:n]).abs().max().item() if n else 0.0
            for name in ("slots", "tokens", "seq_lens", "generation"):
                x, y = getattr(a, name), getattr(b, name)
                assert torch.equal(x, y), (f"step {t}, slots {plan.batch}: {name} with default buckets {x.tolist()} "
                                           f"vs padded to {MAX_TOKENS}: {y.tolist()} (max logit difference {gap:.2e})")
        for name in ("tokens", "seq_lens"):  # request rows; row 0 is the padding row
            x, y = exact.stack.relay.buffers[name][1:], padded.stack.relay.buffers[name][1:]
            assert torch.equal(x, y), f"relay.{name} rows differ at slots {(x != y).nonzero().flatten().tolist()}"
    finally:
        close_stack(exact.stack)
        close_stack(padded.stack)


def test_memory_flat_over_1000_replays(twins):
    """1,000 real decode replays (100 per bucket pass, cycling the decode buckets) allocate nothing:
    allocated and reserved device memory are the same before and after every replay, and no
    static buffer moves. If this failed, a long-running engine would grow memory every
    iteration until it ran out, or its graphs would read freed buffers."""
    graph = twins[0]
    stack, relay = graph.stack, graph.stack.relay
    join_all([graph], range(1, MAX_REQS + 1), seed=3)
    rng = random.Random(5)
    with gc_paused():
        decode_buckets = [b for b in BUCKETS if b <= MAX_BATCH]
        for chunk in range(REPLAYS // 100):
            bucket = decode_buckets[chunk % len(decode_buckets)]
            slots = rng.sample(range(1, MAX_REQS + 1), bucket)
            # Rewind the requests to seq len 4 so 100 more tokens stay inside max_seq_len (256).
            index = torch.tensor(slots, device=DEVICE)
            relay.publish(index, torch.full((bucket,), 4, dtype=torch.int32, device=DEVICE))
            stack.inputs.load([decode_span(s, graph.params[s]) for s in slots], bucket, 1)
            torch.cuda.synchronize()
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            for replay in range(100):
                assert stack.runner.run(bucket) == bucket
                assert torch.cuda.memory_allocated() == allocated, f"bucket {bucket}, replay {replay} allocated memory"
            torch.cuda.synchronize()
            assert torch.cuda.memory_reserved() == reserved, f"bucket {bucket}: reserved memory grew over 100 replays"
            assert torch.cuda.memory_allocated() == allocated, f"bucket {bucket}: allocated memory grew over 100 replays"
    # The replays really decoded: every request in the last chunk is 100 tokens further.
    assert relay.buffers["seq_lens"][index].tolist() == [104] * len(slots)
    assert_same_addresses(stack.addresses, static_addresses(stack), "after 1,000 replays")


def test_mirror_consumer_never_sees_unfinished_iteration(twins):
    """The GPU is held back (a sleep queued before each replay) so the captured mirror write
    lands long after the host launched it: polling that iteration returns None until its event
    fired, never a partly written ring slot, and what poll or wait then returns equals the eager
    twin's iteration row for row. If this failed, an overlap loop would hand the scheduler
    tokens or seq lens from a slot the GPU was still writing (or from an older iteration)."""
    graph, eager = twins
    slots = [5, 17, 2, 9, 11, 3]
    join_all(twins, slots, seed=6)
    stream = graph.stack.stream
    first = graph.iteration  # after the joining prompts' iteration
    for it in range(first, first + 12):
        batch = slots[: 1 + it % len(slots)]  # the padding changes every iteration
        eager.launch(batch)
        expected = eager.read(it)
        torch.cuda._sleep(SLEEP_CYCLES)  # queued on the stream ahead of the replay
        graph.launch(batch)
        mirror = graph.stack.mirror
        assert mirror.poll(it) is None, f"iteration {it}: poll returned before the write ran"
        if it > first:
            earlier = mirror.poll(it - 1)  # launched before the sleep: may be ready
            if earlier is not None:
                assert_same_read(earlier, eager.read(it - 1), f"iteration {it - 1} polled during {it}")
        stream.synchronize()
        got = mirror.poll(it)
        assert got is not None, f"iteration {it}: poll returned None after the stream finished"
        assert_same_read(got, expected, f"iteration {it}")
        assert got.slots.tolist() == batch


def test_staging_reuse_waits_for_pending_copies(twins):
    """Loads back to back while the GPU is held back: IterationInputs has two pinned staging
    copies, so the third load must wait for the first copy before rewriting it. Each iteration
    reaches the device intact (as the kernel right after its load sees it). If this failed, a
    fast scheduler would replay a graph over the NEXT iteration's slots and sampling params."""
    inputs = twins[0].stack.inputs
    batches = [[3 + i, 20 - i, 7 + i][: 1 + i % 3] for i in range(6)]
    seen = torch.zeros((len(batches), 5), dtype=torch.int64, device=DEVICE)
    waits, waited_s = inputs.staging_waits, inputs.staging_wait_s
    torch.cuda._sleep(SLEEP_CYCLES)
    for i, slots in enumerate(batches):
        inputs.load([decode_span(s, GREEDY) for s in slots], 4, 1)
        seen[i].copy_(inputs.buffers.span_slot[:5])  # what a replay launched now would read
    torch.cuda.synchronize()
    for i, slots in enumerate(batches):
        assert seen[i].tolist() == slots + [0] * (5 - len(slots)), f"load {i} of {slots} was overwritten"
    assert inputs.staging_waits > waits, "the loads never had to wait: the race was not exercised"
    assert inputs.staging_wait_s > waited_s  # and the host time they blocked is counted apart


def test_a_repeated_decode_load_leaves_the_device_layout_in_place(twins):
    """Steady decode copies nothing: a load equal to the last one is skipped, and what a replay
    reads is still that layout, even after another layout came and went in between."""
    inputs = twins[0].stack.inputs
    first, other = [decode_span(s, GREEDY) for s in (3, 9)], [decode_span(s, GREEDY) for s in (5,)]
    skipped = inputs.loads_skipped
    torch.cuda._sleep(SLEEP_CYCLES)  # the copies queue behind it
    for spans in (first, other, first, first, first):
        inputs.load(list(spans), 4, 1)
    torch.cuda.synchronize()
    assert inputs.loads_skipped == skipped + 2
    assert inputs.buffers.span_slot[:3].tolist() == [3, 9, 0]
    assert inputs.buffers.span_decode[:3].tolist() == [1, 1, 0]
