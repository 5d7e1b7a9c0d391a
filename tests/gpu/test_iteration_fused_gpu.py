"""The fused iteration prologue and epilogue on CUDA: each kernel equals the glue it replaces bit
for bit; the whole step on them, captured per token bucket, replays with zero host syncs and
equals the same step run eagerly on the torch glue, read for read and state for state; and the
captured graphs are smaller by the nodes the glue took."""

from __future__ import annotations

import random

import pytest
import torch

from graphrelay.capture.iteration.buckets import default_buckets
from graphrelay.capture.serving.sync_count import HostSyncCounter
from capture_cases import (Driver, assert_same_read, assert_same_state, build_stack, close_stack, composition_schedule,
                           step_state)
from relay_cases import bits
from test_iteration_epilogue import Iteration, glue, state
from test_iteration_epilogue import build as build_epilogue
from test_iteration_prologue import HIDDEN, MAX_TOKENS as PROLOGUE_TOKENS, VOCAB, random_spans, run
from test_iteration_prologue import build as build_prologue
from graphrelay.capture.kernels.iteration_epilogue import stash_publish_mirror
from graphrelay.capture.iteration.step import IterationStep

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
MAX_REQS, MAX_BATCH, MAX_TOKENS = 24, 16, 256
BUCKETS = default_buckets(MAX_TOKENS)
STEPS = 48
# What the plain step's glue took per graph, whatever the bucket (each op is one kernel):
# before the layers, span_decode.bool, where (resolve slots), relay.resolve, seq_lens.copy_,
# where (base), index_select + add (positions), lt, index_select + mul_ (slots), clamp_, where +
# index_copy_ (ids), index_select (row positions), the embedding index_select: 15 -> 1; after
# sampling, bool + where (reported), add (new seq lens), stash_and_publish, ne + lt + and
# (emitted), where (mirror slots), add + add (mirror seq lens), mirror.write: 11 -> 1.
NODES_SAVED = 14 + 10  # the glue launches counted in step.py; the H200 measured 28 (some ops launch two kernels)


@pytest.mark.parametrize("seed", range(24))
def test_fused_prologue_equals_the_glue_on_cuda(seed):
    rng = random.Random(seed)
    per, bucket = rng.choice([1, 3]), rng.randint(1, PROLOGUE_TOKENS)
    dtypes = rng.choice(["int32", "int64"]), rng.choice(["int32", "int64"])
    embed = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16)
    spans = random_spans(rng, per, bucket)
    want = run("torch", build_prologue(per, *dtypes, rng.choice(["torch", "triton"]), seed, DEVICE), embed, per,
               spans, bucket, embeds=per == 1)
    got = run("triton", build_prologue(per, *dtypes, "torch", seed, DEVICE), embed, per, spans, bucket,
              embeds=per == 1)
    for name in want:
        assert torch.equal(bits(got[name]), bits(want[name])), f"seed {seed}: {name} differs (spans {spans})"


@pytest.mark.parametrize("mirror_triton", [True, False], ids=["triton-mirror", "torch-mirror"])
def test_fused_epilogue_equals_stash_publish_and_mirror_write_on_cuda(mirror_triton):
    glue_relay, glue_mirror = build_epilogue("int32", "int32", "triton", mirror_triton, 3, DEVICE)
    fused_relay, fused_mirror = build_epilogue("int32", "int32", "triton", mirror_triton, 3, DEVICE)
    gen = torch.Generator().manual_seed(3)
    pad = torch.tensor([5], device=DEVICE)
    for n, rows in enumerate([1, 8, 3, 8, 5, 2, 7]):  # longer than the ring: it wraps
        it = Iteration(gen, rows, DEVICE)
        glue(glue_relay, glue_mirror, it)
        stash_publish_mirror(fused_relay, fused_mirror, torch.cat([it.span_slot, pad]),
                             torch.cat([it.span_samples, pad]), it.row_live, it.target, it.row_positions)
        want, got = state(glue_relay, glue_mirror), state(fused_relay, fused_mirror)
        for name in want:
            assert torch.equal(bits(got[name]), bits(want[name])), f"iteration {n}: {name} differs"


def glue_twin(stack) -> IterationStep:
    """`stack`'s step rebuilt over the same parts on the torch glue."""
    engine = stack.engine
    step = IterationStep(engine.relay, engine.model, engine.mirror, engine.inputs, max_top_k=engine.config.max_top_k,
                         backend="torch")
    engine.step = engine.runner.step = stack.step = step
    return step


@pytest.mark.parametrize("max_top_k", [None, 64], ids=["whole-vocab", "ranked-64"])
def test_captured_fused_step_equals_the_eager_glue_with_zero_syncs(max_top_k):
    """A changing batch through a captured step on the fused kernels (the engine's default on
    CUDA) and an eager twin on the glue: every read and the whole state agree bit for bit after
    every iteration, and the replays make no host sync. With a ranked width (the engine's
    default) the fused epilogue also runs the sampler's last pass. If this failed, the fused
    kernels would change what an engine generates, or stall every iteration on the host."""
    sizes = dict(max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS, max_top_k=max_top_k)
    graph = Driver(build_stack(DEVICE, use_graphs=True, **sizes))
    assert graph.stack.step.prologue.backend == "triton" and graph.stack.step.fused_epilogue
    assert graph.stack.step.pick_in_epilogue == (max_top_k is not None)
    eager = Driver(build_stack(DEVICE, use_graphs=False, plan=graph.stack.model.plan, **sizes))
    glue_twin(eager.stack)
    try:
        for t, plan in enumerate(composition_schedule(STEPS, MAX_REQS, MAX_BATCH, seed=6)):
            with HostSyncCounter(True) as syncs:
                ran = graph.apply(plan)
            assert syncs.count == 0, f"step {t}: the replay made {syncs.count} host syncs"
            assert eager.apply(plan) == ran
            context = f"step {t} (bucket {ran})"
            assert_same_state(step_state(graph.stack, ran), step_state(eager.stack, ran), context)
            assert_same_read(graph.read(t), eager.read(t), context)
    finally:
        for driver in (graph, eager):
            close_stack(driver.stack)


def test_fused_graphs_drop_the_glue_nodes():
    """Every bucket's graph on the fused kernels has at least NODES_SAVED fewer nodes than the
    same bucket captured over the glue (the model, LM head and sampler are the same in both),
    the same saving at every bucket."""
    stack = build_stack(DEVICE, use_graphs=True, max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS)
    try:
        fused = dict(stack.runner.report.nodes)
        plan = stack.model.plan
        stack.runner.graphs.clear()
        glue_twin(stack)
        glued = stack.engine.capture(plan).nodes
        saved = {bucket: glued[bucket] - fused[bucket] for bucket in BUCKETS}
        assert len(set(saved.values())) == 1 and min(saved.values()) >= NODES_SAVED, \
            f"nodes saved per bucket: {saved} (fused {fused}, glue {glued})"
    finally:
        close_stack(stack)


def test_the_pick_in_the_epilogue_saves_one_node_per_bucket():
    """With the Triton sampler (a ranked width), the plain step's graphs are one node smaller
    at every bucket than the same step with the sampler's own last pass: the relay and the
    mirror cost no launch beyond the sampler's."""
    stack = build_stack(DEVICE, use_graphs=True, max_reqs=MAX_REQS, max_batch=MAX_BATCH, max_tokens=MAX_TOKENS,
                        max_top_k=64)
    try:
        assert stack.step.pick_in_epilogue
        picked = dict(stack.runner.report.nodes)
        stack.runner.graphs.clear()
        stack.step.pick_in_epilogue = False
        separate = stack.engine.capture(stack.model.plan).nodes
        assert {bucket: separate[bucket] - picked[bucket] for bucket in BUCKETS} == {bucket: 1 for bucket in BUCKETS}
    finally:
        close_stack(stack)
