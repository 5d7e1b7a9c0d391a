"""The fused Triton kernels (under TRITON_INTERPRET=1 on CPU) equal the torch path bit for bit."""

from __future__ import annotations

import pytest
import torch

from graphrelay import FieldSpec, Relay, RelayConfig
from relay_cases import (
    bits,
    full_config,
    padded_bucket,
    random_payload,
    random_publish,
    snapshot,
)

def run_script(backend: str, config: RelayConfig, seed: int, device: str, steps: int = 6) -> tuple[list, dict]:
    """Admit, stash, publish and resolve random padded buckets; return every resolve and the state."""
    relay = Relay(config, device, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    outs = []
    live = list(range(1, config.max_reqs + 1))
    relay.admit(live)
    for _ in range(steps):
        bs = int(torch.randint(1, config.max_batch + 1, (1,), generator=gen))
        n = int(torch.randint(0, bs + 1, (1,), generator=gen))
        slots = torch.randperm(config.max_reqs, generator=gen)[:n].add(1).tolist()
        idx = padded_bucket(slots, bs, gen, device)
        payload = random_payload(relay, bs, gen)
        seq_lens, confidence = random_publish(relay, bs, gen)
        if int(torch.randint(0, 2, (1,), generator=gen)):
            relay.stash_and_publish(idx, payload, seq_lens, confidence)
        else:
            relay.stash(idx, payload)
            relay.publish(idx, seq_lens, confidence)
        read = padded_bucket(torch.randperm(config.max_reqs, generator=gen)[:n].add(1).tolist(), bs, gen, device)
        outs.append(relay.resolve(read))
    return outs, snapshot(relay)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("debug", [False, True])
def test_triton_equals_torch_bit_for_bit(seed, debug, device):
    config = full_config(debug=debug)
    ref_outs, ref_state = run_script("torch", config, seed, device)
    tri_outs, tri_state = run_script("triton", config, seed, device)
    for ref, tri in zip(ref_outs, tri_outs):
        for name in ref.__struct_fields__:
            a, b = getattr(ref, name), getattr(tri, name)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), name
    # Which bad row's error is kept when several rows of one launch fail is unspecified on the
    # GPU (programs race for the record); the error code must agree.
    assert ref_state.pop("_error")[0] == tri_state.pop("_error")[0]
    for name in ref_state:
        assert torch.equal(bits(ref_state[name]), bits(tri_state[name])), name


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float32_to_bfloat16_rounds_to_nearest_even_and_keeps_nan(backend, device):
    config = RelayConfig.plain(4, 8, hidden=FieldSpec((6,), "bfloat16"))
    relay = Relay(config, device, backend=backend)
    relay.admit([1])
    # Values sitting exactly on and around bf16 rounding boundaries, plus specials.
    hidden = torch.tensor(
        [[1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), float("nan"), float("inf"), 1.0 + 2**-8 + 2**-20]],
        dtype=torch.float32,
    )
    payload = relay.alloc_payload(1)
    payload.tokens.fill_(3)
    payload = type(payload)(tokens=payload.tokens.to(device), hidden=hidden.to(device))
    relay.stash(torch.tensor([1], device=device), payload)
    expected = hidden.to(torch.bfloat16)
    assert torch.equal(bits(relay.buffers["hidden"][1].cpu()), bits(expected[0]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gather_casts_into_out_dtype(backend, device):
    """An out= buffer of another dtype (int64 input_ids from int32 storage) gets a cast copy."""
    config = RelayConfig.plain(5, 4)
    relay = Relay(config, device, backend=backend)
    relay.admit([2, 4])
    idx = torch.tensor([2, 4, 0], device=device)
    relay.stash(idx, relay.alloc_payload(3).__class__(tokens=torch.tensor([11, 22, 33], device=device)))
    relay.publish(idx, torch.tensor([5, 6, 7], device=device))
    out = relay.alloc_resolved(4)
    out = type(out)(tokens=torch.zeros(4, dtype=torch.int64, device=device), seq_lens=out.seq_lens)
    view = out.narrow(3)
    result = relay.resolve(torch.tensor([4, 0, 2], device=device), out=view)
    assert result.tokens.data_ptr() == out.tokens.data_ptr()
    assert result.tokens.cpu().tolist() == [22, 0, 11]
    assert result.seq_lens.cpu().tolist() == [6, 1, 5]


def test_large_buckets_use_wider_chunks_and_still_match(device):
    """Buckets above 64 rows split rows into fewer, wider chunks (backend.chunk_bytes)."""
    from graphrelay.backend import chunk_bytes

    bs = 96
    assert chunk_bytes(bs) != chunk_bytes(1)
    config = full_config(max_reqs=128, max_batch=bs, hidden=FieldSpec((1500,), "bfloat16"))
    states = []
    for backend in ("torch", "triton"):
        relay = Relay(config, device, backend=backend)
        gen = torch.Generator().manual_seed(5)
        relay.admit(list(range(1, 129)))
        idx = padded_bucket(torch.randperm(128, generator=gen)[:90].add(1).tolist(), bs, gen, device)
        relay.stash_and_publish(idx, random_payload(relay, bs, gen), *random_publish(relay, bs, gen))
        out = relay.resolve(idx.flip(0))
        states.append((out, snapshot(relay)))
    (ref_out, ref_state), (tri_out, tri_state) = states
    for name in ref_out.__struct_fields__:
        assert torch.equal(bits(getattr(ref_out, name)), bits(getattr(tri_out, name))), name
    for name in ref_state:
        assert torch.equal(bits(ref_state[name]), bits(tri_state[name])), name
