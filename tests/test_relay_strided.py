"""Strided views (index tensors, payloads, `out=` buffers) give exactly what contiguous
tensors with the same values give, on both backends (Triton under the interpreter on CPU)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrelay import Relay, RelayPayload, Resolved
from graphrelay.fields import STASH
from relay_cases import bits, full_config, layouts, random_payload, random_publish, snapshot, strided_copy

# sparse_topk is [2, 3] per slot: strided 2-D rows that do not collapse into one run.
CONFIG = full_config(max_reqs=9, max_batch=5)
FIELD_DIMS = {f.name: 1 + len(f.shape) for f in Relay(CONFIG).fields}


def bucket(bs: int):
    """bs slot ids; real slots at most once, repeats become padding."""
    return st.lists(st.integers(0, CONFIG.max_reqs), min_size=bs, max_size=bs).map(
        lambda xs: [x if x == 0 or xs.index(x) == i else 0 for i, x in enumerate(xs)]
    )


@st.composite
def cases(draw):
    bs = draw(st.integers(1, CONFIG.max_batch))
    return dict(
        write=draw(bucket(bs)),
        read=draw(bucket(bs)),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        fused=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        # One layout per index tensor, payload tensor and out= buffer.
        layout={
            **{key: draw(layouts(1)) for key in ("write", "read")},
            **{f"in.{name}": draw(layouts(n)) for name, n in FIELD_DIMS.items()},
            **{f"out.{name}": draw(layouts(n)) for name, n in FIELD_DIMS.items()},
        },
    )


def run(backend: str, case: dict, strided: bool):
    """Admit every slot, write the `write` bucket, gather the `read` bucket into out= buffers;
    with `strided`, every caller tensor is a strided view holding the same values."""
    view = (lambda t, key: strided_copy(t, case["layout"][key])) if strided else (lambda t, key: t)
    relay = Relay(CONFIG, backend=backend)
    relay.admit(range(1, CONFIG.max_reqs + 1))
    gen = torch.Generator().manual_seed(case["seed"])
    bs = len(case["write"])
    payload = random_payload(relay, bs, gen)
    payload = RelayPayload(**{f.name: view(getattr(payload, f.name), f"in.{f.name}") for f in relay.fields if f.group == STASH})
    seq_lens, confidence = random_publish(relay, bs, gen)
    seq_lens, confidence = view(seq_lens, "in.seq_lens"), view(confidence, "in.confidence")
    write = view(torch.tensor(case["write"], dtype=case["index_dtype"]), "write")
    read = view(torch.tensor(case["read"], dtype=case["index_dtype"]), "read")
    if case["fused"]:
        relay.stash_and_publish(write, payload, seq_lens, confidence)
    else:
        relay.stash(write, payload)
        relay.publish(write, seq_lens, confidence)
    out = relay.alloc_resolved(bs)
    out = Resolved(**{f.name: view(getattr(out, f.name), f"out.{f.name}") for f in relay.fields})
    got = relay.resolve(read, out=out)
    assert all(getattr(got, f.name) is getattr(out, f.name) for f in relay.fields)
    return {f"out.{f.name}": getattr(got, f.name) for f in relay.fields} | snapshot(relay)


def check(backend: str, case: dict) -> None:
    contiguous, strided = run(backend, case, strided=False), run(backend, case, strided=True)
    for name in contiguous:
        assert torch.equal(bits(contiguous[name]), bits(strided[name])), name


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_torch_strided_views_equal_contiguous(case):
    check("torch", case)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_triton_strided_views_equal_contiguous(case):
    check("triton", case)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_column_of_a_2d_index_tensor_reads_and_writes_its_own_slots(backend, device):
    """The issue's case: a non-contiguous column view of indices used to be read as if
    contiguous by the kernels, resolving other requests' rows and stashing into them."""
    relay = Relay(full_config(max_reqs=8, max_batch=4), device, backend=backend)
    relay.admit([1, 2, 3, 5, 6, 7])
    gen = torch.Generator().manual_seed(0)
    pairs = torch.tensor([[3, 5], [1, 6], [2, 7]], device=device)
    idx = pairs[:, 0]  # [3, 1, 2], stride 2
    payload = msgspec.structs.replace(random_payload(relay, 3, gen), tokens=torch.tensor([30, 10, 20], device=device))
    relay.stash_and_publish(idx, payload, *random_publish(relay, 3, gen))
    assert relay.buffers["tokens"][[1, 2, 3, 5, 6, 7]].tolist() == [10, 20, 30, 7, 7, 7]  # 7: pad token
    assert relay.resolve(idx).tokens.tolist() == [30, 10, 20]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_expanded_payload_broadcasts_one_row(backend, device):
    """A stride-0 batch dim (`t.expand(bs)`) is a valid input: every row reads the same value."""
    relay = Relay(full_config(max_reqs=8, max_batch=4, confidence=None), device, backend=backend)
    relay.admit([1, 2, 3])
    gen = torch.Generator().manual_seed(1)
    idx = torch.tensor([1, 2, 3], device=device)
    payload = random_payload(relay, 3, gen)
    seq_lens = torch.tensor([42], dtype=torch.int64, device=device).expand(3)
    relay.stash_and_publish(idx, payload, seq_lens)
    assert relay.resolve(idx).seq_lens.tolist() == [42, 42, 42]


def test_an_out_buffer_whose_elements_alias_is_rejected():
    relay = Relay(full_config(max_reqs=8, max_batch=4))
    out = relay.alloc_resolved(2)
    aliased = msgspec.structs.replace(out, tokens=torch.zeros(1, dtype=torch.int32).expand(2))
    with pytest.raises(ValueError, match="out.tokens has elements that share memory"):
        relay.resolve(torch.tensor([1, 0]), out=aliased)
