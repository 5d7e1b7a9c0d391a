"""CPU tests of the host mirror: poll/wait/overrun/stale semantics against a plain-Python model,
validation that changes nothing, and the Triton write (TRITON_INTERPRET=1) against torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrelay import Relay
from graphrelay.config import FieldSpec, RelayConfig
from graphrelay.mirror import HostMirror, MirrorOverrun
from graphrelay.runtime import Event, Stream
from relay_cases import layouts, strided_copy

FULL = RelayConfig(
    max_reqs=6,
    max_batch=4,
    accept_len=FieldSpec((), "int16"),
    confidence=FieldSpec((3,), "float32"),
)
PLAIN = RelayConfig.plain(max_reqs=6, max_batch=4)


class Harness:
    """A mirror bound to a relay, whose generation tables (device and host) it reads."""

    def __init__(self, config=FULL, depth=3, **mirror_options):
        self.config = config
        self.relay = Relay(config, "cpu")
        self.mirror = HostMirror(self.relay, depth=depth, **mirror_options)
        self.generation = self.relay.generation  # the "device" table
        self.host_generation = self.relay.host_generation
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
        self.mirror.write(torch.tensor(indices, dtype=torch.int64), **values)
        self.mirror.record(self.iteration, self.stream)
        self.iteration += 1
        return values

    def admit(self, slot):
        self.relay.admit([slot])

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
                    read(iteration)
            elif iteration + depth <= last:
                with pytest.raises(MirrorOverrun, match=f"depth {depth}"):
                    read(iteration)
            else:
                result = read(iteration)  # host mode: events always fired
                assert result.iteration == iteration
                assert_read_matches(result, history[iteration], h.host_generation)
                fresh = result.fresh()
                assert not fresh.stale.any() and len(fresh) == int((~result.stale).sum())


# ---- targeted semantics ---------------------------------------------------------------------


def test_poll_returns_none_until_the_event_fires(monkeypatch):
    h = Harness()
    values = h.launch([3, 1])
    monkeypatch.setattr(Event, "query", lambda self: False)  # the GPU is still running it
    assert h.mirror.poll(0) is None
    monkeypatch.undo()
    read = h.mirror.poll(0)
    assert_read_matches(read, expected_rows([3, 1], values, h.generation), h.host_generation)


def test_padding_rows_are_dropped_and_order_kept():
    h = Harness(PLAIN)
    h.launch([0, 5, 0, 2])
    read = h.mirror.wait(0)
    assert read.slots.tolist() == [5, 2]
    assert read.tokens.tolist() == [10, 30]  # rows 1 and 3 of the batch
    assert read.accept_len is None and read.confidence is None


def test_a_reused_slot_is_reported_stale_never_fresh():
    h = Harness()
    h.launch([2, 4])
    h.admit(2)  # slot 2 finished and went to a new request after iteration 0 launched
    read = h.mirror.poll(0)
    assert read.slots.tolist() == [2, 4] and read.stale.tolist() == [True, False]
    assert read.fresh().slots.tolist() == [4]
    h.launch([2, 4])  # the new owner's values carry the new generation
    assert h.mirror.poll(1).stale.tolist() == [False, False]


def test_overrun_is_detected_at_exactly_depth_behind():
    h = Harness(depth=3)
    for _ in range(4):
        h.launch([1])
    with pytest.raises(MirrorOverrun, match="keeps only iterations 1..3"):
        h.mirror.poll(0)
    assert isinstance(MirrorOverrun("x"), RuntimeError)
    assert h.mirror.poll(1).iteration == 1  # lag 2 with depth 3 is fine


def test_reads_are_copies_that_survive_ring_reuse():
    h = Harness(depth=1)
    h.launch([1, 2])
    first = h.mirror.poll(0)
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
        h.mirror.poll(0)
    h.launch([1])
    with pytest.raises(ValueError, match="iteration 1 was not recorded.*last recorded: 0"):
        h.mirror.wait(1)


def test_a_mirror_is_bound_to_a_relay():
    with pytest.raises(ValueError, match="HostMirror takes the Relay it mirrors"):
        HostMirror(PLAIN, depth=3)
    relay = Relay(PLAIN, "cpu")
    mirror = HostMirror(relay)
    assert mirror.relay is relay and mirror.config is PLAIN and mirror.device == relay.device


def test_warm_up_without_reset_is_caught_and_reset_fixes_it():
    h = Harness(depth=3)
    h.mirror.write(torch.tensor([1]), **h.values([1], seed=99))  # a warm-up run
    for _ in range(3):
        h.launch([1])
    with pytest.raises(RuntimeError, match="holds iteration 3, expected 0.*reset"):
        h.mirror.poll(0)

    h.mirror.reset()
    h.iteration = 0
    values = h.launch([1, 2])
    assert torch.equal(h.mirror._counter, torch.tensor([1]))
    read = h.mirror.poll(0)
    assert_read_matches(read, expected_rows([1, 2], values, h.generation), h.host_generation)


def test_an_empty_bucket_is_still_an_iteration():
    h = Harness()
    h.launch([])
    h.launch([0, 0])
    assert len(h.mirror.poll(0)) == 0
    assert len(h.mirror.poll(1)) == 0


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
        ("indices on meta", dict(indices=torch.ones(2, dtype=i64, device="meta")), ValueError, "indices is on meta"),
        ("tokens float", dict(tokens=torch.ones(2)), ValueError, "tokens dtype.*integer"),
        ("tokens shape", dict(tokens=torch.ones(3, dtype=i64)), ValueError,
         "tokens has shape \\(3,\\), expected \\(2,"),
        ("token too large", dict(tokens=torch.tensor([5, 2**40])), ValueError,
         "tokens holds 1099511627776, which does not fit the relay's torch.int32.*RelayConfig.token_dtype"),
        ("seq_lens bool", dict(seq_lens=torch.ones(2, dtype=torch.bool)), ValueError, "seq_lens dtype"),
        ("accept_len too large", dict(accept_len=torch.tensor([0, 2**15])), ValueError,
         "accept_len holds 32768.*RelayConfig.accept_len.dtype"),
        ("missing accept_len", dict(accept_len=None), ValueError, "declares accept_len; pass accept_len="),
        ("confidence shape", dict(confidence=torch.ones(2, 4)), ValueError,
         "confidence has shape \\(2, 4\\)"),
        ("confidence int", dict(confidence=torch.ones(2, 3, dtype=i64)), ValueError,
         "confidence dtype torch.int64 must be a float dtype"),
        ("confidence float64", dict(confidence=torch.ones(2, 3, dtype=f64)), ValueError,
         "float64 and bool are not accepted"),
        ("tokens a list", dict(tokens=[1, 2]), ValueError, "tokens must be a torch.Tensor"),
        ("tokens on meta", dict(tokens=torch.ones(2, dtype=i64, device="meta")), ValueError, "is on meta"),
    ]


@pytest.mark.parametrize("case", _bad_writes(), ids=lambda c: c[0])
def test_bad_writes_raise_and_change_nothing(case):
    _, overrides, error, message = case
    h = Harness()
    h.launch([1, 2])
    before = h.ring_state()
    args = dict(indices=torch.tensor([3, 4]), **h.values([3, 4], seed=5))
    args.update(overrides)
    with pytest.raises(error, match=message):
        h.mirror.write(**args)
    after = h.ring_state()
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_validation_can_be_turned_off_at_construction_or_for_a_block():
    checked, trusting = Harness(PLAIN), Harness(PLAIN, validate=False)
    args = (torch.tensor([1, 2]), torch.tensor([2**32 + 5, 6]), torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit"):
        checked.mirror.write(*args)
    assert checked.mirror.validate and not trusting.mirror.validate
    trusting.mirror.write(*args)  # the caller vouched for the inputs: the token wraps
    with checked.mirror.validation(False):
        assert not checked.mirror.validate
        checked.mirror.write(*args)
    assert checked.mirror.validate
    for h in (checked, trusting):
        h.mirror.record(0, h.stream)
        assert h.mirror.poll(0).tokens.tolist() == [5, 6]
    with pytest.raises(AttributeError):
        checked.mirror.validate = False  # switched per block, never by assignment


def test_fields_the_config_lacks_are_rejected():
    h = Harness(PLAIN)
    with pytest.raises(ValueError, match="declares no confidence"):
        h.mirror.write(torch.tensor([1]), torch.ones(1, dtype=torch.int32),
                       torch.ones(1, dtype=torch.int32), confidence=torch.ones(1, 3))


@pytest.mark.parametrize("depth", [0, -2, 1.0, True])
def test_bad_depth_is_rejected(depth):
    with pytest.raises(ValueError, match="depth must be a positive int"):
        HostMirror(Relay(PLAIN), depth=depth)


@pytest.mark.parametrize("option, value", [("use_triton", "yes"), ("use_triton", 1), ("validate", 0), ("validate", None)])
def test_flags_must_be_bools(option, value):
    with pytest.raises(ValueError, match=f"{option}=.*must be True or False"):
        HostMirror(Relay(PLAIN), **{option: value})


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        HostMirror(Relay(PLAIN), use_triton=True)


def test_close_frees_the_ring_and_stops_use():
    h = Harness()
    h.launch([1])
    h.mirror.close()
    assert h.mirror._ring.released
    with pytest.raises(RuntimeError, match="closed"):
        h.mirror.poll(0)
    with pytest.raises(RuntimeError, match="closed"):
        h.mirror.write(torch.tensor([1]), **h.values([1], seed=0))


# ---- the fused Triton write (interpreted) equals the torch reference bit for bit ------------

CAST_CONFIG = RelayConfig(
    max_reqs=300,
    max_batch=130,  # more than one 128-row block
    token_dtype="int32",
    seq_len_dtype="int64",
    accept_len=FieldSpec((), "int16"),
    confidence=FieldSpec((2, 3), "bfloat16"),  # 2-D per-row shape
)


def cast_args(bs: int, seed: int, index_dtype: torch.dtype) -> tuple:
    """Write arguments for CAST_CONFIG in dtypes other than the ring's, so every store casts:
    int64 tokens (in int32 range) and accept_len (in int16 range), float32 confidence
    rounded to bfloat16."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, CAST_CONFIG.rows, (bs,), generator=g).to(index_dtype),
        torch.randint(-(2**31), 2**31, (bs,), generator=g),
        torch.randint(0, 2**20, (bs,), generator=g, dtype=torch.int32),
        torch.randint(0, 2**15, (bs,), generator=g),
        torch.randn(bs, 2, 3, generator=g),
    )


def ring_bytes(mirror: HostMirror) -> torch.Tensor:
    return mirror._ring.host_view(torch.uint8, (mirror._ring.nbytes,))


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
    relay = Relay(CAST_CONFIG)
    relay.generation.copy_(torch.randint(0, 2**40, (CAST_CONFIG.rows,)))
    mirrors = [HostMirror(relay, depth=3, use_triton=flag) for flag in (False, True)]
    for bs, seed in batches:
        args = cast_args(bs, seed, index_dtype)
        for mirror in mirrors:
            mirror.write(*args)
        assert torch.equal(ring_bytes(mirrors[0]), ring_bytes(mirrors[1]))
        assert torch.equal(mirrors[0]._counter, mirrors[1]._counter)


def test_confidence_is_cast_like_the_relay_casts_it():
    """float32 confidence into a bfloat16 ring rounds to nearest even on both paths, as the
    relay's stores do (torch's own cast is the reference)."""
    relay = Relay(CAST_CONFIG)
    args = cast_args(3, seed=7, index_dtype=torch.int64)
    for use_triton in (False, True):
        mirror = HostMirror(relay, use_triton=use_triton)
        mirror.write(*args)
        mirror.record(0, Stream("cpu"))
        read = mirror.poll(0)
        keep = args[0] != 0
        assert torch.equal(read.confidence.view(torch.int16), args[4][keep].to(torch.bfloat16).view(torch.int16))


@settings(max_examples=25, deadline=None)
@given(
    bs=st.integers(0, 6),
    seed=st.integers(0, 2**31),
    use_triton=st.booleans(),
    layout=st.fixed_dictionaries({
        "indices": layouts(1), "tokens": layouts(1), "seq_lens": layouts(1), "accept_len": layouts(1),
        "confidence": layouts(3),
    }),
)
def test_strided_inputs_write_what_contiguous_ones_do(bs, seed, use_triton, layout):
    """Every write input as a strided view (a column of a wider tensor, every other row,
    dims in another memory order) fills the ring exactly as contiguous tensors would."""
    relay = Relay(CAST_CONFIG)
    mirrors = [HostMirror(relay, use_triton=use_triton) for _ in range(2)]
    args = cast_args(bs, seed, torch.int64)
    names = ("indices", "tokens", "seq_lens", "accept_len", "confidence")
    mirrors[0].write(*args)
    mirrors[1].write(*(strided_copy(t, layout[name]) for t, name in zip(args, names)))
    assert torch.equal(ring_bytes(mirrors[0]), ring_bytes(mirrors[1]))
