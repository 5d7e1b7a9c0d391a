"""The adopter seams: resolving a subset of fields in one launch, caller-chosen `out` dtypes,
and `import graphrelay` without Triton."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphrelay import Relay, RelayConfig, RelayDebugError, RelayPayload
from relay_cases import bits, full_config, random_payload, random_publish

CONFIG = full_config(max_reqs=8, max_batch=4)


def written_relay(backend: str, config: RelayConfig = CONFIG, device="cpu") -> Relay:
    relay = Relay(config, device, backend=backend)
    relay.admit([1, 2, 3])
    gen = torch.Generator().manual_seed(0)
    relay.stash_and_publish(torch.tensor([1, 2, 3, 0], device=device), random_payload(relay, 4, gen), *random_publish(relay, 4, gen))
    return relay


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_subset_resolve_reads_only_those_fields(backend, device):
    relay = written_relay(backend, device=device)
    idx = torch.tensor([3, 0, 1], device=device)
    full = relay.resolve(idx)
    out = relay.alloc_resolved(3)
    marker = {name: getattr(out, name).fill_(5).clone() for name in out.__struct_fields__ if getattr(out, name) is not None}
    got = relay.resolve(idx, out=out, fields=("seq_lens", "tokens"))
    assert [name for name in got.__struct_fields__ if getattr(got, name) is not None] == ["tokens", "seq_lens"]
    for name in ("tokens", "seq_lens"):
        assert getattr(got, name) is getattr(out, name)
        assert torch.equal(getattr(got, name), getattr(full, name))
    for name, before in marker.items():
        if name not in ("tokens", "seq_lens"):
            assert torch.equal(bits(getattr(out, name)), bits(before)), f"{name} was written"
    alone = relay.resolve(idx, fields=["hidden"])
    assert alone.tokens is None and torch.equal(bits(alone.hidden), bits(full.hidden))


def test_a_subset_resolve_is_one_launch(monkeypatch):
    relay = written_relay("triton")
    launches = []
    kernel = relay._kernels.gather_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(relay._kernels, "gather_kernel", Counting())
    relay.resolve(torch.tensor([1, 2]), fields=("tokens", "hidden", "confidence"))
    assert len(launches) == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_debug_consumes_each_field_on_its_own(backend):
    """Tokens before the forward, seq lens after: two reads of one write, no double read."""
    relay = Relay(RelayConfig.plain(6, 4, debug=True), backend=backend)
    relay.admit([1, 2])
    idx = torch.tensor([1, 2])
    relay.stash_and_publish(idx, RelayPayload(tokens=torch.tensor([5, 6])), torch.tensor([3, 4]))
    assert relay.resolve(idx, fields=("tokens",)).tokens.tolist() == [5, 6]
    assert relay.resolve(idx, fields=("seq_lens",)).seq_lens.tolist() == [3, 4]
    relay.check()
    relay.resolve(idx, fields=("tokens",))
    with pytest.raises(RelayDebugError) as info:
        relay.check()
    assert (info.value.slot, info.value.field) == (1, "tokens")


@pytest.mark.parametrize(
    "fields, message",
    [
        ("tokens", "sequence of field names"),
        (("tokens", "tokens"), "each once"),
        ((), "one or more"),
        (("tokens", "hiden"), "'hiden' is not a field of this relay"),
    ],
)
def test_bad_field_subsets_are_rejected(fields, message):
    relay = Relay(CONFIG)
    with pytest.raises(ValueError, match=message):
        relay.resolve(torch.tensor([1]), fields=fields)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_alloc_resolved_takes_the_callers_dtypes(backend, device):
    relay = written_relay(backend, device=device)
    out = relay.alloc_resolved(dtypes={"tokens": torch.int64, "hidden": torch.float32})
    assert out.tokens.dtype == torch.int64 and out.hidden.dtype == torch.float32
    assert out.seq_lens.dtype == torch.int32  # storage dtype where not named
    idx = torch.tensor([2, 1, 0], device=device)
    got = relay.resolve(idx, out=out.narrow(3))
    assert torch.equal(got.tokens, relay.buffers["tokens"][idx].long())
    assert torch.equal(bits(got.hidden), bits(relay.buffers["hidden"][idx].float()))


@pytest.mark.parametrize(
    "dtypes, message",
    [
        ({"tokens": torch.float32}, "must be an integer dtype"),
        ({"hidden": torch.int32}, "must be a float dtype"),
        ({"topk_p": torch.float64}, "float64 and bool are not accepted"),
        ({"tokens": torch.int8}, "cannot hold every torch.int32"),
        ({"tokens": "int64"}, "must be a torch.dtype"),
        ({"logits": torch.float32}, "'logits' is not a field of this relay"),
    ],
)
def test_alloc_resolved_rejects_dtypes_it_cannot_cast_into(dtypes, message):
    with pytest.raises(ValueError, match=message):
        Relay(CONFIG).alloc_resolved(dtypes=dtypes)


IMPORT_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch
import graphrelay
from graphrelay import HostMirror, Relay, RelayConfig, RelayPayload
from graphrelay.runtime import Stream

relay = Relay(RelayConfig.plain(4, 2), "cpu")
relay.admit([1])
idx = torch.tensor([1, 0])
relay.stash_and_publish(idx, RelayPayload(tokens=torch.tensor([7, 0])), torch.tensor([3, 0]))
assert relay.resolve(idx).tokens.tolist() == [7, 0]
mirror = HostMirror(relay)
mirror.write(idx, torch.tensor([7, 0]), torch.tensor([3, 0]))
mirror.record(0, Stream("cpu"))
assert mirror.poll(0).tokens.tolist() == [7]
assert not [m for m in sys.modules if m.startswith("graphrelay.") and "kernels" in m], sorted(sys.modules)
try:
    Relay(RelayConfig.plain(4, 2), "cpu", backend="triton")
except ImportError as exc:
    print("triton backend:", exc)
else:
    raise AssertionError("the triton backend loaded without triton")
"""


def test_import_graphrelay_needs_no_triton():
    """An engine on a CPU-only machine (or one that ships without Triton) imports graphrelay
    and uses the torch backend; asking for Triton then says what is missing."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", IMPORT_WITHOUT_TRITON], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "install triton, or use the pure-torch path" in done.stdout
