"""The fused plain-iteration epilogue (one Triton program, interpreted here) against the glue it
replaces -- the relay's standalone `stash_and_publish` and the mirror's `write` (each on its
torch and Triton backends) over the step's torch ops -- bit for bit, over runs of iterations
longer than the ring (so it wraps): relay rows, every ring array, and the mirror's counter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrelay import FieldSpec, Relay, RelayConfig, RelayPayload
from graphrelay.capture.kernels.iteration_epilogue import check_fusable, stash_publish_mirror
from graphrelay.capture.kernels.sampling_kernel import sample_chunks, sample_triton
from graphrelay.mirror import HostMirror
from relay_cases import bits

MAX_REQS, MAX_BATCH, DEPTH = 9, 8, 3


class Iteration:
    """One iteration's sampled rows: span r's slot, whether it reports, whether its row may be
    emitted, its token and the position it sampled after."""

    def __init__(self, gen: torch.Generator, rows: int, device: str = "cpu"):
        slots = torch.randperm(MAX_REQS, generator=gen)[:rows] + 1
        span_slot = torch.where(torch.rand(rows, generator=gen) < 0.2, 0, slots)
        span_samples = (torch.rand(rows, generator=gen) < 0.7).long()
        row_live = span_samples * (torch.rand(rows, generator=gen) < 0.9).long()
        target = torch.randint(0, 30000, (rows,), generator=gen)
        row_positions = torch.randint(0, 4096, (rows,), generator=gen)
        self.span_slot, self.span_samples, self.row_live, self.target, self.row_positions = (
            t.to(device) for t in (span_slot, span_samples, row_live, target, row_positions))


def build(token_dtype: str, seq_len_dtype: str, relay_backend: str, mirror_triton: bool, seed: int,
          device: str = "cpu"):
    config = RelayConfig(max_reqs=MAX_REQS, max_batch=MAX_BATCH, token_dtype=token_dtype, seq_len_dtype=seq_len_dtype,
                         pad_token_id=2, seq_len_fill=1)
    relay = Relay(config, device, backend=relay_backend, validate=False)
    gen = torch.Generator().manual_seed(seed)
    relay.buffers["tokens"][1:] = torch.randint(0, 100, (MAX_REQS,), generator=gen)
    relay.buffers["seq_lens"][1:] = torch.randint(0, 100, (MAX_REQS,), generator=gen)
    relay.admit([1, 4, 7])
    relay.admit([4])  # generations differ between slots
    return relay, HostMirror(relay, depth=DEPTH, use_triton=mirror_triton, validate=False)


def glue(relay: Relay, mirror: HostMirror, it: Iteration) -> None:
    """What the step runs after sampling without the fused epilogue (one row per span)."""
    reported = torch.where(it.span_samples.bool(), it.span_slot, 0)
    relay.stash_and_publish(reported, RelayPayload(tokens=it.target), it.row_positions + 1)
    emitted = it.row_live != 0
    mirror.write(torch.where(emitted, reported, 0), it.target, it.row_positions + 1)


def state(relay: Relay, mirror: HostMirror) -> dict[str, torch.Tensor]:
    ring, counter = mirror.device_ring  # on the CPU the device views are the host's
    out = {f"relay.{name}": t.clone() for name, t in relay.buffers.items()}
    out.update({f"ring.{name}": t.clone() for name, t in ring._asdict().items() if t is not None})
    out["counter"] = counter.clone()
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), sizes=st.lists(st.integers(1, MAX_BATCH), min_size=1, max_size=2 * DEPTH + 1),
       token_dtype=st.sampled_from(["int32", "int64"]), seq_len_dtype=st.sampled_from(["int32", "int64"]),
       relay_backend=st.sampled_from(["torch", "triton"]), mirror_triton=st.booleans())
def test_fused_epilogue_equals_stash_publish_and_mirror_write(seed, sizes, token_dtype, seq_len_dtype,
                                                              relay_backend, mirror_triton):
    """After every iteration, the relay rows (row 0 untouched), the ring's rows, counts and
    stamps and the device counter equal what the library ops wrote. If this failed, the host
    would read other tokens than the relay carries to the next iteration, or a ring slot the
    counter did not stamp."""
    glue_relay, glue_mirror = build(token_dtype, seq_len_dtype, relay_backend, mirror_triton, seed)
    fused_relay, fused_mirror = build(token_dtype, seq_len_dtype, relay_backend, mirror_triton, seed)
    check_fusable(fused_relay, fused_mirror)
    gen = torch.Generator().manual_seed(seed)
    for n, rows in enumerate(sizes):
        it = Iteration(gen, rows)
        glue(glue_relay, glue_mirror, it)
        # The step hands the kernel its [R + 1] span views; the padding entry must not be read.
        pad = torch.tensor([5])
        stash_publish_mirror(fused_relay, fused_mirror, torch.cat([it.span_slot, pad]),
                             torch.cat([it.span_samples, pad]), it.row_live, it.target, it.row_positions)
        want, got = state(glue_relay, glue_mirror), state(fused_relay, fused_mirror)
        for name in want:
            assert torch.equal(bits(got[name]), bits(want[name])), \
                f"iteration {n} ({rows} rows): {name} differs: fused {got[name].tolist()} vs glue {want[name].tolist()}"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), sizes=st.lists(st.integers(1, MAX_BATCH), min_size=1, max_size=DEPTH + 1),
       vocab=st.integers(1, 200), chunk=st.sampled_from([16, 64]))
def test_the_epilogue_picks_the_samplers_tokens(seed, sizes, vocab, chunk):
    """Given the sampler's chunk results, the epilogue's own last pass writes into `target`
    exactly the tokens the three-launch sampler returns (greedy rows, temperature, top-k and
    top-p rows, ties from rounded logits), and the relay and the ring then hold what the library
    ops write for those tokens. If this failed, the plain step would emit other tokens than the
    sampler draws."""
    glue_relay, glue_mirror = build("int32", "int64", "torch", False, seed)
    fused_relay, fused_mirror = build("int32", "int64", "torch", False, seed)
    gen = torch.Generator().manual_seed(seed)
    for n, rows in enumerate(sizes):
        it = Iteration(gen, rows)
        logits = (3 * torch.randn(rows, vocab, generator=gen)).round().to(torch.bfloat16)
        temperature = torch.where(torch.rand(rows, generator=gen) < 0.4, 0.0, 0.3 + torch.rand(rows, generator=gen))
        top_k = torch.randint(0, vocab + 2, (rows,), generator=gen)
        top_p = torch.where(torch.rand(rows, generator=gen) < 0.5, 0.2 + 0.7 * torch.rand(rows, generator=gen), 1.0)
        seeds, steps = torch.randint(0, 2**40, (2, rows), generator=gen)
        width = min(vocab, 32)
        it.target = sample_triton(logits, temperature, top_k, top_p, seeds, steps, torch.empty(rows, dtype=torch.int64),
                                  width, chunk=chunk)
        glue(glue_relay, glue_mirror, it)
        picks = sample_chunks(logits, temperature, top_k, top_p, seeds, steps, width, chunk=chunk)
        target = torch.full((rows,), -1, dtype=torch.int64)
        stash_publish_mirror(fused_relay, fused_mirror, it.span_slot, it.span_samples, it.row_live, target,
                             it.row_positions, picks=picks)
        assert torch.equal(target, it.target), f"iteration {n}: picked {target.tolist()}, sampled {it.target.tolist()}"
        want, got = state(glue_relay, glue_mirror), state(fused_relay, fused_mirror)
        for name in want:
            assert torch.equal(bits(got[name]), bits(want[name])), f"iteration {n} ({rows} rows): {name} differs"


def test_picks_must_cover_the_rows():
    relay, mirror = build("int32", "int32", "torch", False, seed=2)
    logits = torch.randn(3, 40)
    params = (torch.zeros(3), torch.zeros(3, dtype=torch.int64), None, torch.zeros(3, dtype=torch.int64),
              torch.zeros(3, dtype=torch.int64))
    picks = sample_chunks(logits, *params, 8)
    counter = mirror.device_ring[1].clone()
    with pytest.raises(ValueError, match="picks hold 3 rows, target 2"):
        stash_publish_mirror(relay, mirror, torch.tensor([1, 4]), torch.tensor([1, 1]), torch.tensor([1, 1]),
                             torch.zeros(2, dtype=torch.int64), torch.tensor([3, 4]), picks=picks)
    assert torch.equal(mirror.device_ring[1], counter)


def test_the_host_reads_the_fused_write():
    """The mirror's reader sees the fused write as its own: emitted rows only, with the slots'
    current generations, the new seq lens, in iteration order."""
    relay, mirror = build("int32", "int32", "torch", False, seed=1)
    slot = torch.tensor([4, 0, 7, 2])
    samples, live = torch.tensor([1, 0, 1, 0]), torch.tensor([1, 0, 0, 0])
    before = relay.buffers["tokens"][2].item()
    stash_publish_mirror(relay, mirror, slot, samples, live, torch.tensor([11, 12, 13, 14]), torch.tensor([5, 6, 7, 8]))
    mirror.record(0, 0)
    read = mirror.wait(0)
    assert read.slots.tolist() == [4] and read.tokens.tolist() == [11] and read.seq_lens.tolist() == [6]
    assert read.generation.tolist() == [2] and not read.stale.any()
    # Slot 7 reported (the relay carries its token) though its row is not emitted; 2 did not report.
    assert relay.buffers["tokens"][[4, 7]].tolist() == [11, 13] and relay.buffers["seq_lens"][7].item() == 8
    assert relay.buffers["tokens"][2].item() == before


def test_only_a_plain_relay_fuses():
    relay = Relay(RelayConfig.plain(MAX_REQS, MAX_BATCH, accept_len=FieldSpec((), "int32")), "cpu", validate=False)
    with pytest.raises(ValueError, match="tokens and publishes seq lens only"):
        check_fusable(relay, HostMirror(relay, validate=False))
    debug = Relay(RelayConfig.plain(MAX_REQS, MAX_BATCH, debug=True), "cpu", validate=False)
    with pytest.raises(ValueError, match="debug"):
        check_fusable(debug, HostMirror(debug, validate=False))
    plain = Relay(RelayConfig.plain(MAX_REQS, MAX_BATCH), "cpu", validate=False)
    with pytest.raises(ValueError, match="bound to the relay"):
        check_fusable(plain, HostMirror(Relay(plain.config, "cpu"), validate=False))
