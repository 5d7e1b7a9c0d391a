"""Random interleavings of admit/stash/publish/resolve against a plain-Python model.

The model keeps, per slot, the last values written for each field (starting from the fill
values) and the generation count. It never lets slot 0 change: padding rows are dropped.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrelay import Relay
from graphrelay.fields import STASH
from relay_cases import bits, full_config, random_payload, random_publish

CONFIG = full_config(max_reqs=9, max_batch=5)


class Model:
    def __init__(self, relay: Relay):
        self.rows = {
            f.name: [torch.full(f.shape, f.fill, dtype=f.dtype) for _ in range(CONFIG.rows)] for f in relay.fields
        }
        self.generation = [0] * CONFIG.rows

    def write(self, indices: list[int], values: dict[str, torch.Tensor]) -> None:
        for row, slot in enumerate(indices):
            if slot != 0:
                for name, value in values.items():
                    self.rows[name][slot] = value[row].to(self.rows[name][slot].dtype)

    def read(self, name: str, indices: list[int]) -> torch.Tensor:
        return torch.stack([self.rows[name][slot] for slot in indices])


bucket = st.lists(st.integers(0, CONFIG.max_reqs), min_size=1, max_size=CONFIG.max_batch).map(
    # Real slots appear at most once per bucket; repeats become padding.
    lambda xs: [x if x == 0 or xs.index(x) == i else 0 for i, x in enumerate(xs)]
)
op = st.tuples(st.sampled_from(["admit", "stash", "publish", "both", "resolve"]), bucket)


def check_program(backend: str, program, seed: int) -> None:
    relay = Relay(CONFIG, backend=backend)
    model = Model(relay)
    gen = torch.Generator().manual_seed(seed)
    for kind, slots in program:
        idx = torch.tensor(slots, dtype=torch.int64)
        bs = len(slots)
        if kind == "admit":
            live = [s for s in slots if s != 0]
            relay.admit(live)
            for s in live:
                model.generation[s] += 1
        if kind in ("stash", "both"):
            payload = random_payload(relay, bs, gen)
            stash_values = {f.name: getattr(payload, f.name) for f in relay.fields if f.group == STASH}
        if kind in ("publish", "both"):
            seq_lens, confidence = random_publish(relay, bs, gen)
            publish_values = {"seq_lens": seq_lens, **({"confidence": confidence} if confidence is not None else {})}
        if kind == "stash":
            relay.stash(idx, payload)
            model.write(slots, stash_values)
        elif kind == "publish":
            relay.publish(idx, seq_lens, confidence)
            model.write(slots, publish_values)
        elif kind == "both":
            relay.stash_and_publish(idx, payload, seq_lens, confidence)
            model.write(slots, {**stash_values, **publish_values})
        elif kind == "resolve":
            out = relay.resolve(idx)
            for f in relay.fields:
                assert torch.equal(bits(getattr(out, f.name)), bits(model.read(f.name, slots))), f.name
        # Padding row 0 always holds the fill values, whatever was written "to" it.
        for f in relay.fields:
            assert torch.equal(bits(relay.buffers[f.name][0]), bits(model.rows[f.name][0])), f.name
    assert relay.generation.tolist() == model.generation == relay.host_generation.tolist()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(op, min_size=1, max_size=25), seed=st.integers(0, 2**16))
def test_torch_path_matches_model(program, seed):
    check_program("torch", program, seed)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(op, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_triton_path_matches_model(program, seed):
    check_program("triton", program, seed)


@settings(max_examples=40, deadline=None)
@given(real=st.lists(st.integers(1, CONFIG.max_reqs), unique=True, max_size=CONFIG.max_batch), seed=st.integers(0, 2**16))
def test_padding_rows_never_change_real_rows(real, seed):
    """Scatter a bucket of padding plus `real` slots: only `real` rows change."""
    relay = Relay(CONFIG)
    gen = torch.Generator().manual_seed(seed)
    before = {name: buf.clone() for name, buf in relay.buffers.items()}
    slots = real + [0] * (CONFIG.max_batch - len(real))
    seq_lens, confidence = random_publish(relay, len(slots), gen)
    relay.stash_and_publish(torch.tensor(slots), random_payload(relay, len(slots), gen), seq_lens, confidence)
    untouched = [s for s in range(CONFIG.rows) if s not in real]
    for name, buf in relay.buffers.items():
        assert torch.equal(bits(buf[untouched]), bits(before[name][untouched])), name
