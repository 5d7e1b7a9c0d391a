"""CPU tests of the host mirror: poll/wait/overrun/stale semantics against a plain-Python model,
validation that changes nothing, and the Triton write (TRITON_INTERPRET=1) against torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrelay.config import FieldSpec, RelayConfig
from graphrelay.mirror import HostMirror, MirrorOverrun
from graphrelay.runtime import Event, Stream

FULL = RelayConfig(
    max_reqs=6,
    max_batch=4,
    accept_len=FieldSpec((), "int16"),
    confidence=FieldSpec((3,), "float32"),
)
PLAIN = RelayConfig.plain(max_reqs=6, max_batch=4)


class Harness:
    """A mirror plus the relay-side state it reads: device and host generation tables."""

    def __init__(self, config=FULL, depth=3, **mirror_options):
        self.config = config
        self.mirror = HostMirror(config, "cpu", depth=depth, **mirror_options)
        self.generation = torch.zeros(config.rows, dtype=torch.int64)  # "device" table
        self.host_generation = torch.zeros(config.rows, dtype=torch.int64)
        self.stream = Stream("cpu")
        self.iteration = 0

    def values(self, indices, seed):
        """Deterministic per-iteration values for rows `indices`."""
        bs = len(indices)
        rows = torch.arange(bs, dtype=torch.int64)
        out = dict(tokens=rows * 10 + seed, seq_lens=(rows + seed).to(torch.int32))
        if self.config.accept_len is not None:
            out["accept_len"] = (rows + seed) % 4
        if self.config.confidence is not None:
            out["confidence"] = torch.rand(bs, 3, generator=torch.Generator().manual_seed(seed))
        return out

    def launch(self, indices, **values):
        """Run one iteration's write and record it, as the serving loop does."""
        values = values or self.values(indices, seed=self.iteration)
        self.mirror.write(torch.tensor(indices, dtype=torch.int64), self.generation, **values)
        self.mirror.record(self.iteration, self.stream)
        self.iteration += 1
        return values

    def admit(self, slot):
        self.generation[slot] += 1
        self.host_generation[slot] += 1

    def ring_state(self):
        ring = self.mirror._ring
        return ring.host_view(torch.uint8, (ring.nbytes,)).clone(), self.mirror._counter.clone()


def expected_rows(indices, values, generation):
    """The model: what a read of that iteration must return (padding dropped, order kept)."""
    keep = [i for i, slot in enumerate(indices) if slot != 0]
    out = {name: [v[i] for i in keep] for name, v in values.items()}
    out["slots"] = [indices[i] for i in keep]
    out["generation"] = [int(generation[indices[i]]) for i in keep]
    return out


def assert_read_matches(read, model, host_generation):
    assert read.slots.tolist() == model["slots"]
    assert read.generation.tolist() == model["generation"]
    assert read.tokens.tolist() == [int(t) for t in model["tokens"]]
    assert read.seq_lens.tolist() == [int(s) for s in model["seq_lens"]]
    if "accept_len" in model:
        assert read.accept_len.tolist() == [int(a) for a in model["accept_len"]]
    if "confidence" in model:
        want = torch.stack(model["confidence"]) if model["confidence"] else torch.empty(0, 3)
        assert torch.equal(read.confidence, want)
    stale = [g != int(host_generation[s]) for s, g in zip(model["slots"], model["generation"])]
    assert read.stale.tolist() == stale


# ---- the property test: random launches, admissions and reads against the model -------------

slots = st.integers(0, FULL.max_reqs)
ops = st.one_of(
    st.tuples(st.just("launch"), st.lists(slots, min_size=0, max_size=FULL.max_batch)),
    st.tuples(st.just("admit"), st.integers(1, FULL.max_reqs)),
    st.tuples(st.sampled_from(["poll", "wait"]), st.integers(-1, 5)),  # lag behind the last launch
)


@settings(max_examples=150, deadline=None)
@given(depth=st.integers(1, 4), program=st.lists(ops, max_size=30))
def test_mirror_matches_model(depth, program):
    h = Harness(FULL, depth=depth)
    history = {}  # iteration -> model rows
    for op, arg in program:
        if op == "launch":
            generation_then = h.generation.clone()
            values = h.launch(arg)
            history[h.iteration - 1] = expected_rows(arg, values, generation_then)
        elif op == "admit":
            h.admit(arg)
        else:
            last = h.iteration - 1
            iteration = last - arg
            read = getattr(h.mirror, op)
            if iteration < 0 or iteration > last:
                with pytest.raises(ValueError, match="was not recorded"):
                    read(iteration, h.host_generation)
            elif iteration + depth <= last:
                with pytest.raises(MirrorOverrun, match=f"depth {depth}"):
                    read(iteration, h.host_generation)
            else:
                result = read(iteration, h.host_generation)  # host mode: events always fired
                assert result.iteration == iteration
                assert_read_matches(result, history[iteration], h.host_generation)
                fresh = result.fresh()
                assert not fresh.stale.any() and len(fresh) == int((~result.stale).sum())


# ---- targeted semantics ---------------------------------------------------------------------


def test_poll_returns_none_until_the_event_fires(monkeypatch):
    h = Harness()
    values = h.launch([3, 1])
    monkeypatch.setattr(Event, "query", lambda self: False)  # the GPU is still running it
    assert h.mirror.poll(0, h.host_generation) is None
    monkeypatch.undo()
    read = h.mirror.poll(0, h.host_generation)
    assert_read_matches(read, expected_rows([3, 1], values, h.generation), h.host_generation)


def test_padding_rows_are_dropped_and_order_kept():
    h = Harness(PLAIN)
    h.launch([0, 5, 0, 2])
    read = h.mirror.wait(0, h.host_generation)
    assert read.slots.tolist() == [5, 2]
    assert read.tokens.tolist() == [10, 30]  # rows 1 and 3 of the batch
    assert read.accept_len is None and read.confidence is None


def test_a_reused_slot_is_reported_stale_never_fresh():
    h = Harness()
    h.launch([2, 4])
    h.admit(2)  # slot 2 finished and went to a new request after iteration 0 launched
    read = h.mirror.poll(0, h.host_generation)
    assert read.slots.tolist() == [2, 4] and read.stale.tolist() == [True, False]
    assert read.fresh().slots.tolist() == [4]
    h.launch([2, 4])  # the new owner's values carry the new generation
    assert h.mirror.poll(1, h.host_generation).stale.tolist() == [False, False]


def test_overrun_is_detected_at_exactly_depth_behind():
    h = Harness(depth=3)
    for _ in range(4):
        h.launch([1])
    with pytest.raises(MirrorOverrun, match="keeps only iterations 1..3"):
        h.mirror.poll(0, h.host_generation)
    assert isinstance(MirrorOverrun("x"), RuntimeError)
    assert h.mirror.poll(1, h.host_generation).iteration == 1  # lag 2 with depth 3 is fine


def test_reads_are_copies_that_survive_ring_reuse():
    h = Harness(depth=1)
    h.launch([1, 2])
    first = h.mirror.poll(0, h.host_generation)
    h.launch([3, 4])
    assert first.slots.tolist() == [1, 2] and first.tokens.tolist() == [0, 10]


def test_record_must_be_in_order_and_a_rejection_changes_nothing():
    h = Harness()
    h.launch([1])
    for bad in (0, 2, -1):
        with pytest.raises(ValueError, match="expected 1"):
            h.mirror.record(bad, h.stream)
    assert h.mirror.last_recorded == 0
    h.launch([1])
    assert h.mirror.last_recorded == 1


def test_unrecorded_iterations_cannot_be_read():
    h = Harness()
    with pytest.raises(ValueError, match="iteration 0 was not recorded"):
        h.mirror.poll(0, h.host_generation)
    h.launch([1])
    with pytest.raises(ValueError, match="iteration 1 was not recorded.*last recorded: 0"):
        h.mirror.wait(1, h.host_generation)


@pytest.mark.parametrize(
    "table", [torch.zeros(7, dtype=torch.int32), torch.zeros(6, dtype=torch.int64), [0] * 7]
)
def test_current_generation_must_be_the_host_table(table):
    h = Harness()
    h.launch([1])
    with pytest.raises(ValueError, match="CPU int64 \\[7\\]"):
        h.mirror.poll(0, table)


def test_warm_up_without_reset_is_caught_and_reset_fixes_it():
    h = Harness(depth=3)
    h.mirror.write(torch.tensor([1]), h.generation, **h.values([1], seed=99))  # a warm-up run
    for _ in range(3):
        h.launch([1])
    with pytest.raises(RuntimeError, match="holds iteration 3, expected 0.*reset"):
        h.mirror.poll(0, h.host_generation)

    h.mirror.reset()
    h.iteration = 0
    values = h.launch([1, 2])
    assert torch.equal(h.mirror._counter, torch.tensor([1]))
    read = h.mirror.poll(0, h.host_generation)
    assert_read_matches(read, expected_rows([1, 2], values, h.generation), h.host_generation)


def test_an_empty_bucket_is_still_an_iteration():
    h = Harness()
    h.launch([])
    h.launch([0, 0])
    assert len(h.mirror.poll(0, h.host_generation)) == 0
    assert len(h.mirror.poll(1, h.host_generation)) == 0


def _bad_writes():
    """(description, kwargs overrides, error, message) for HostMirror.write on FULL with bs 2."""
    i64, f64 = torch.int64, torch.float64
    return [
        ("2-D indices", dict(indices=torch.ones(1, 2, dtype=i64)), ValueError, "1-D"),
        ("too many rows", dict(indices=torch.ones(5, dtype=i64)), ValueError, "max_batch = 4"),
        ("float indices", dict(indices=torch.ones(2)), ValueError, "int32 or int64"),
        ("index past max_reqs", dict(indices=torch.tensor([1, 7])), IndexError,
         "\\[7\\] outside 0..max_reqs = 6"),
        ("negative index", dict(indices=torch.tensor([-1, 2])), IndexError, "\\[-1\\] outside"),
        ("generation int32", dict(generation=torch.zeros(7, dtype=torch.int32)), ValueError,
         "generation has dtype"),
        ("generation short", dict(generation=torch.zeros(6, dtype=i64)), ValueError,
         "generation has shape \\(6,\\)"),
        ("tokens float", dict(tokens=torch.ones(2)), ValueError, "tokens has dtype.*integer"),
        ("tokens shape", dict(tokens=torch.ones(3, dtype=i64)), ValueError,
         "tokens has shape \\(3,\\), expected \\(2,\\)"),
        ("seq_lens bool", dict(seq_lens=torch.ones(2, dtype=torch.bool)), ValueError, "seq_lens has dtype"),
        ("seq_lens strided", dict(seq_lens=torch.ones(4, dtype=i64)[::2]), ValueError, "contiguous"),
        ("missing accept_len", dict(accept_len=None), ValueError, "declares accept_len; pass accept_len="),
        ("confidence shape", dict(confidence=torch.ones(2, 4)), ValueError,
         "confidence has shape \\(2, 4\\)"),
        ("confidence int", dict(confidence=torch.ones(2, 3, dtype=i64)), ValueError,
         "it must be torch.float32"),
        ("confidence float64", dict(confidence=torch.ones(2, 3, dtype=f64)), ValueError,
         "the config's dtype"),
        ("tokens a list", dict(tokens=[1, 2]), ValueError, "tokens must be a tensor"),
        ("tokens on meta", dict(tokens=torch.ones(2, dtype=i64, device="meta")), ValueError, "is on meta"),
    ]


@pytest.mark.parametrize("case", _bad_writes(), ids=lambda c: c[0])
def test_bad_writes_raise_and_change_nothing(case):
    _, overrides, error, message = case
    h = Harness()
    h.launch([1, 2])
    before = h.ring_state()
    args = dict(indices=torch.tensor([3, 4]), generation=h.generation, **h.values([3, 4], seed=5))
    args.update(overrides)
    with pytest.raises(error, match=message):
        h.mirror.write(**args)
    after = h.ring_state()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_validate_false_skips_the_host_checks():
    checked, trusting = Harness(PLAIN), Harness(PLAIN, validate=False)
    strided = torch.arange(8, dtype=torch.int32)[::2]  # valid values, but not contiguous
    args = (torch.tensor([1, 2, 3, 4]), checked.generation, torch.arange(4), strided)
    with pytest.raises(ValueError, match="contiguous"):
        checked.mirror.write(*args)
    trusting.mirror.write(*args)  # the torch path copes; the caller vouched for the inputs
    trusting.mirror.record(0, trusting.stream)
    assert trusting.mirror.poll(0, trusting.host_generation).seq_lens.tolist() == [0, 2, 4, 6]


def test_fields_the_config_lacks_are_rejected():
    h = Harness(PLAIN)
    with pytest.raises(ValueError, match="declares no confidence"):
        h.mirror.write(torch.tensor([1]), h.generation, torch.ones(1, dtype=torch.int32),
                       torch.ones(1, dtype=torch.int32), confidence=torch.ones(1, 3))


@pytest.mark.parametrize("depth", [0, -2, 1.0, True])
def test_bad_depth_is_rejected(depth):
    with pytest.raises(ValueError, match="depth must be a positive int"):
        HostMirror(PLAIN, "cpu", depth=depth)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        HostMirror(PLAIN, "cpu", use_triton=True)


def test_close_frees_the_ring_and_stops_use():
    h = Harness()
    h.launch([1])
    h.mirror.close()
    assert h.mirror._ring.released
    with pytest.raises(RuntimeError, match="closed"):
        h.mirror.poll(0, h.host_generation)
    with pytest.raises(RuntimeError, match="closed"):
        h.mirror.write(torch.tensor([1]), h.generation, **h.values([1], seed=0))


# ---- the fused Triton write (interpreted) equals the torch reference bit for bit ------------

CAST_CONFIG = RelayConfig(
    max_reqs=300,
    max_batch=130,  # more than one 128-row block
    token_dtype="int32",
    seq_len_dtype="int64",
    accept_len=FieldSpec((), "int16"),
    confidence=FieldSpec((2, 3), "bfloat16"),  # 2-D per-row shape
)


@settings(max_examples=12, deadline=None)
@given(
    batches=st.lists(
        st.tuples(st.sampled_from([0, 1, 2, 16, 129, 130]), st.integers(0, 2**31)),
        min_size=1,
        max_size=5,
    ),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_triton_write_equals_torch_bit_for_bit(batches, index_dtype):
    cfg = CAST_CONFIG
    mirrors = [HostMirror(cfg, "cpu", depth=3, use_triton=flag) for flag in (False, True)]
    generation = torch.randint(0, 2**40, (cfg.rows,), dtype=torch.int64)
    for bs, seed in batches:
        g = torch.Generator().manual_seed(seed)
        args = (
            torch.randint(0, cfg.rows, (bs,), generator=g).to(index_dtype),
            generation,
            torch.randint(-(2**40), 2**40, (bs,), generator=g),  # int64 tokens, truncated to int32
            torch.randint(0, 2**20, (bs,), generator=g, dtype=torch.int32),
            torch.randint(0, 2**20, (bs,), generator=g),  # int64 accept_len, truncated to int16
            torch.randn(bs, 2, 3, generator=g).to(torch.bfloat16),
        )
        for mirror in mirrors:
            mirror.write(*args)
        rings = [m._ring.host_view(torch.uint8, (m._ring.nbytes,)) for m in mirrors]
        assert torch.equal(rings[0], rings[1])
        assert torch.equal(mirrors[0]._counter, mirrors[1]._counter)
