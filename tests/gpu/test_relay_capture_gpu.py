"""Relay ops inside CUDA graphs (issue 2 item 7, issue 6 item 3): stash + publish + resolve
captured together as ONE graph per bucket, replayed with the static index and payload buffers
mutated in place, against the same ops run eagerly on a twin relay, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from capture_cases import gc_paused, state_differences, sync_debug_error
from graphrelay import FieldSpec, Relay, RelayPayload, Resolved
from graphrelay.fields import STASH
from relay_cases import SOURCE_DTYPE, full_config, snapshot, strided_copy

pytestmark = pytest.mark.gpu

BUCKETS = (1, 7, 16)
# Every optional field (EAGLE top-k and hidden, draft probs, sparse top-k, n-gram, confidence)
# in mixed dtypes. The hidden row (4100) is wider than a kernel block (2048) and not a power of
# two, so the chunked, masked copy loop runs inside the graph.
CFG = full_config(max_reqs=40, max_batch=16, hidden=FieldSpec((4100,), "bfloat16"))
REPLAYS = 1000
PROPERTY_CASES = 150
INT_SENTINEL, FLOAT_SENTINEL = 31337, -77.25  # what padding rows carry: a leak is recognisable


class RelayRig:
    """A relay whose ops are captured per bucket, an identical twin that runs the same ops
    eagerly, and the static inputs both read: index buffers and payloads `[max_batch, ...]` in
    source dtypes that differ from the storage dtypes, so every store casts."""

    def __init__(self):
        self.device = torch.device("cuda", torch.cuda.current_device())
        # validate=False: host-side checks read index values (a sync), which capture forbids.
        self.relay = Relay(CFG, self.device, validate=False)
        self.twin = Relay(CFG, self.device, validate=False)
        mb = CFG.max_batch
        self.gen = torch.Generator(device=self.device).manual_seed(1234)
        self.write_idx = torch.zeros(mb, dtype=torch.int64, device=self.device)
        self.read_idx = torch.zeros(mb, dtype=torch.int32, device=self.device)  # both index dtypes
        self.values = {
            f.name: torch.zeros((mb, *f.shape), dtype=SOURCE_DTYPE[f.dtype], device=self.device)
            for f in self.relay.fields
        }
        self.out = self.relay.alloc_resolved()
        self.twin_out = self.twin.alloc_resolved()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def ops(self, relay: Relay, out, bs: int) -> None:
        """One iteration's relay work on `[:bs]` views: scatter, then gather (which therefore
        sees this iteration's writes for rows in both index sets)."""
        v = {name: t[:bs] for name, t in self.values.items()}
        stash = RelayPayload(**{f.name: v[f.name] for f in relay.fields if f.group == STASH})
        relay.stash(self.write_idx[:bs], stash)
        relay.publish(self.write_idx[:bs], v["seq_lens"], v["confidence"])
        relay.resolve(self.read_idx[:bs], out=out.narrow(bs))

    def capture(self) -> None:
        """Warm up under sync-debug "error" on a side stream, then capture largest first into
        one shared pool, in the default global capture mode."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        for bs in sorted(BUCKETS, reverse=True):
            self.randomize(bs, pad_prob=0.3)
            side.wait_stream(current)
            with sync_debug_error(), torch.cuda.stream(side):
                for _ in range(2):  # the first call compiles each Triton specialization
                    self.ops(self.relay, self.out, bs)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="global"):
                self.ops(self.relay, self.out, bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def randomize(self, bs: int, pad_prob: float) -> None:
        """New random values into the first bs rows of every static input, in place (copy_):
        unique live slots, each row padding (slot 0) with probability pad_prob."""
        for idx in (self.write_idx, self.read_idx):
            slots = torch.randperm(CFG.max_reqs, generator=self.gen, device=self.device)[:bs] + 1
            pad = torch.rand(bs, generator=self.gen, device=self.device) < pad_prob
            idx[:bs].copy_(torch.where(pad, 0, slots))
        for t in self.values.values():
            if t.dtype.is_floating_point:
                new = torch.randn(bs, *t.shape[1:], generator=self.gen, device=self.device) * 3
            else:
                new = torch.randint(0, 30000, (bs, *t.shape[1:]), generator=self.gen, device=self.device)
            t[:bs].copy_(new)

    def sync_twin(self) -> None:
        """Start the twin from the captured relay's current state."""
        for name, buf in self.relay.buffers.items():
            self.twin.buffers[name].copy_(buf)
        self.twin.generation.copy_(self.relay.generation)
        self.twin.host_generation.copy_(self.relay.host_generation)

    def addresses(self) -> dict[str, int]:
        """Everything the graphs bake in by address, including the relay's debug bookkeeping
        that the kernels bind even with debug off."""
        tensors = {f"relay.{k}": v for k, v in self.relay.buffers.items()}
        tensors.update({"relay.generation": self.relay.generation, "relay._state": self.relay._state,
                        "relay._error": self.relay._error, "write_idx": self.write_idx, "read_idx": self.read_idx})
        tensors.update({f"input.{k}": v for k, v in self.values.items()})
        tensors.update({f"out.{f.name}": getattr(self.out, f.name) for f in self.relay.fields})
        return {k: v.data_ptr() for k, v in tensors.items()}


def outputs(relay: Relay, out, bs: int) -> dict[str, torch.Tensor]:
    """The relay's whole state (dim 0 = slot) and the gathered rows (dim 0 = batch row)."""
    state = {f"relay.{k}[slot]": v for k, v in snapshot(relay).items()}
    state.update({f"resolved.{f.name}[row]": getattr(out, f.name)[:bs] for f in relay.fields})
    return state


@pytest.fixture(scope="module")
def rig():
    rig = RelayRig()
    rig.addresses_before_capture = rig.addresses()
    rig.capture()
    yield rig
    torch.cuda.synchronize()


def test_capture_in_global_mode_after_sync_debug_warm_up(rig):
    """Capture of stash + publish + resolve succeeded for every bucket in the default global
    mode, after warm-ups that ran under sync-debug "error" (the fixture would have raised). If
    this failed, an engine could not put the relay inside its decode graph at all: it would be
    back to SGLang's eager relay around the graph, with its launch cost and host syncs."""
    assert sorted(rig.graphs) == sorted(BUCKETS)
    assert torch.cuda.get_sync_debug_mode() == 0, "the warm-up left sync-debug mode on"
    # The check has teeth: the validating relay reads index values, and the mode catches it.
    checking = Relay(CFG, rig.device, validate=True)
    with sync_debug_error(), pytest.raises(RuntimeError, match="synchroniz"):
        checking.resolve(rig.read_idx[:7], out=checking.alloc_resolved(7))


def test_replays_with_mutated_inputs_equal_eager_twin(rig):
    """1,000 replays cycling through the buckets, each after new random indices (padding
    included, sometimes all padding) and payloads were copied into the static buffers in place.
    After every replay the relay's whole state and the gathered rows equal the twin's, which ran
    the same ops eagerly, bit for bit; no replay allocates; no static buffer moves. If this
    failed, a captured engine would decode from stale or wrong relay rows (inputs baked in at
    capture), diverge from eager mode, leak memory per iteration, or read freed memory."""
    rig.sync_twin()
    rng = random.Random(0)
    with gc_paused():
        allocated = torch.cuda.memory_allocated()
        for replay in range(REPLAYS):
            bs = BUCKETS[replay % len(BUCKETS)]
            rig.randomize(bs, pad_prob=rng.choice((0.0, 0.3, 0.7, 1.0)))
            before = torch.cuda.memory_allocated()
            rig.graphs[bs].replay()
            assert torch.cuda.memory_allocated() == before, f"replay {replay} (bucket {bs}) allocated memory"
            rig.ops(rig.twin, rig.twin_out, bs)
            diffs = state_differences(outputs(rig.relay, rig.out, bs), outputs(rig.twin, rig.twin_out, bs))
            assert not diffs, (
                f"replay {replay}, bucket {bs}, write slots {rig.write_idx[:bs].tolist()}, read slots "
                f"{rig.read_idx[:bs].tolist()}: graph differs from eager:\n  " + "\n  ".join(diffs))
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == allocated, "memory allocated grew across the replays"
    moved = {k: v for k, v in rig.addresses().items() if rig.addresses_before_capture[k] != v}
    assert not moved, f"static buffers moved after capture: {sorted(moved)}"


def test_padding_rows_never_change_live_rows(rig):
    """Property test on the captured path: for random buckets of unique live slots mixed with
    padding rows that carry sentinel payloads, one replay changes exactly the live slots' rows
    (to their payloads, cast), leaves every other row (row 0 included) untouched, and the
    gather returns those rows, with fill values at padding. If this failed, a padded bucket
    (every batch that is not exactly a bucket size) would corrupt a live request's tokens, seq
    len or draft state, which no per-request test would notice."""
    rng = random.Random(42)
    fields = rig.relay.fields
    for case in range(PROPERTY_CASES):
        bs = rng.choice(BUCKETS)
        live = rng.sample(range(1, CFG.max_reqs + 1), 0 if case == 0 else rng.randint(0, bs))
        rows = live + [0] * (bs - len(live))
        rng.shuffle(rows)
        others = rng.sample(range(1, CFG.max_reqs + 1), bs)
        reads = [s for s in dict.fromkeys(live + others)][:bs]  # written and unwritten slots
        reads = [0 if rng.random() < 0.3 else s for s in reads]
        rng.shuffle(reads)

        rig.randomize(bs, pad_prob=0.0)
        rig.write_idx[:bs].copy_(torch.tensor(rows))
        rig.read_idx[:bs].copy_(torch.tensor(reads))
        pad = rig.write_idx[:bs] == 0  # [bs]
        for t in rig.values.values():
            t[:bs][pad] = FLOAT_SENTINEL if t.dtype.is_floating_point else INT_SENTINEL

        expected = {f.name: rig.relay.buffers[f.name].clone() for f in fields}
        live_pos = (~pad).nonzero().squeeze(1)  # [n live]
        live_slots = rig.write_idx[:bs][live_pos]
        for f in fields:
            expected[f.name][live_slots] = rig.values[f.name][:bs][live_pos].to(f.dtype)
        rig.graphs[bs].replay()

        where = f"case {case}, bucket {bs}, write slots {rows}, read slots {reads}"
        diffs = state_differences({f"relay.{k}[slot]": rig.relay.buffers[k] for k in expected},
                                  {f"relay.{k}[slot]": v for k, v in expected.items()})
        assert not diffs, f"{where}: relay rows wrong after the replay:\n  " + "\n  ".join(diffs)
        read_idx = rig.read_idx[:bs].long()
        diffs = state_differences({f"resolved.{f.name}[row]": getattr(rig.out, f.name)[:bs] for f in fields},
                                  {f"resolved.{f.name}[row]": expected[f.name][read_idx] for f in fields})
        assert not diffs, f"{where}: gathered rows wrong:\n  " + "\n  ".join(diffs)
        for f in fields:  # row 0 is never written, so gathers at padding return the fill value
            assert bool((rig.relay.buffers[f.name][0] == f.fill).all()), f"{where}: padding row 0 of {f.name} changed"


def test_strided_views_inside_capture_equal_contiguous_eager_ops():
    """Captured resolve + stash_and_publish bound to strided views (indices that are the
    columns of one [bs, 2] tensor, payloads and out= buffers laid out every other element in
    reversed dim order) replay what the same ops on contiguous copies give eagerly, bit for
    bit. If this failed, an engine whose slots or sampled tokens are views of a wider tensor
    would read and write other requests' rows inside its graph."""
    device = torch.device("cuda", torch.cuda.current_device())
    relay, twin = Relay(CFG, device, validate=False), Relay(CFG, device, validate=False)
    bs = 7
    gen = torch.Generator(device=device).manual_seed(99)

    def layout(n: int):  # dims in reverse memory order, every other element, offset 1
        return tuple(reversed(range(n))), (2,) * n, (1,) * n

    pairs = torch.zeros(bs, 2, dtype=torch.int64, device=device)
    write_idx, read_idx = pairs[:, 0], pairs[:, 1]
    values = {f.name: strided_copy(torch.zeros((bs, *f.shape), dtype=SOURCE_DTYPE[f.dtype], device=device), layout(1 + len(f.shape)))
              for f in relay.fields}
    out = Resolved(**{f.name: strided_copy(torch.zeros((bs, *f.shape), dtype=f.dtype, device=device), layout(1 + len(f.shape)))
                      for f in relay.fields})
    twin_out = twin.alloc_resolved(bs)

    def ops(r: Relay, idx: tuple, v: dict, o: Resolved) -> None:
        payload = RelayPayload(**{f.name: v[f.name] for f in r.fields if f.group == STASH})
        r.stash_and_publish(idx[0], payload, v["seq_lens"], v["confidence"])
        r.resolve(idx[1], out=o)

    def randomize() -> None:
        slots = torch.randperm(CFG.max_reqs, generator=gen, device=device)[: 2 * bs] + 1
        pad = torch.rand(2 * bs, generator=gen, device=device) < 0.3
        pairs.copy_(torch.where(pad, 0, slots).view(bs, 2))
        for t in values.values():
            new = torch.randn(t.shape, generator=gen, device=device) * 3
            t.copy_(new if t.dtype.is_floating_point else new.abs().mul(1000).long())

    randomize()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):  # the first call compiles the strided specializations
            ops(relay, (write_idx, read_idx), values, out)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops(relay, (write_idx, read_idx), values, out)
    torch.cuda.synchronize(device)
    for name, buf in relay.buffers.items():
        twin.buffers[name].copy_(buf)
    for replay in range(50):
        randomize()
        graph.replay()
        dense = {k: v.clone(memory_format=torch.contiguous_format) for k, v in values.items()}
        ops(twin, (write_idx.clone(), read_idx.clone()), dense, twin_out)
        diffs = state_differences(outputs(relay, out, bs), outputs(twin, twin_out, bs))
        assert not diffs, f"replay {replay}, slots {pairs.tolist()}: graph differs from eager:\n  " + "\n  ".join(diffs)
