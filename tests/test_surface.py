"""The static input surface (DecodeInputs): padding policy, errors, `[:bs]` views and stable
addresses. Captured graphs read these buffers by address, so every property here is one a
replay silently depends on."""

from __future__ import annotations

import pytest
import torch

from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.surface import DecodeInputs, HostBatch

MAX_BATCH = 8
PADDING = {"slots": 0, "temperature": 0.0, "top_k": 0, "seeds": 0, "top_p": 1.0}  # greedy rows on slot 0
DTYPES = {"slots": torch.int64, "temperature": torch.float32, "top_k": torch.int32, "seeds": torch.int64,
          "top_p": torch.float32}


def batch_of(slots: list[int]) -> HostBatch:
    """Distinct non-padding values in every column, so a padded row is recognisable."""
    params = [SamplingParams(temperature=0.5 + s, top_k=s + 1, seed=1000 + s, top_p=1 / (s + 2)) for s in slots]
    return HostBatch(slots=list(slots), params=params)


def expected_columns(batch: HostBatch, bs: int) -> dict[str, list]:
    pad = bs - len(batch.slots)
    return {
        "slots": batch.slots + [PADDING["slots"]] * pad,
        "temperature": [p.temperature for p in batch.params] + [PADDING["temperature"]] * pad,
        "top_k": [p.top_k for p in batch.params] + [PADDING["top_k"]] * pad,
        "seeds": [p.seed for p in batch.params] + [PADDING["seeds"]] * pad,
        "top_p": [p.top_p for p in batch.params] + [PADDING["top_p"]] * pad,
    }


def test_buffers_have_fixed_dtypes_shapes_and_alignment():
    """One [max_batch] buffer per field in the dtype the step expects, 16-byte aligned for
    vectorised kernels. If this failed, the step would cast (allocate) inside the graph."""
    inputs = DecodeInputs(MAX_BATCH, "cpu")
    assert set(inputs.buffers._fields) == set(DTYPES)
    for name in inputs.buffers._fields:
        t = getattr(inputs.buffers, name)
        assert t.dtype == DTYPES[name], name
        assert t.shape == (MAX_BATCH,), name
        assert t.data_ptr() % 16 == 0, f"{name} is not 16-byte aligned"


@pytest.mark.parametrize("n, bs", [(3, 4), (1, 8), (0, 1), (8, 8)])
def test_load_writes_batch_then_padding(n, bs):
    """Rows 0..n-1 hold the batch, rows n..bs-1 each field's padding value, even when a larger
    batch left other values there. If this failed, padded rows would decode with a stale
    request's slot and temperature and overwrite that request's state."""
    inputs = DecodeInputs(MAX_BATCH, "cpu")
    inputs.load(batch_of(list(range(1, MAX_BATCH + 1))), MAX_BATCH)  # dirty every row first
    batch = batch_of([7, 2, 5, 1, 8, 3, 4, 6][:n])
    inputs.load(batch, bs)
    view = inputs.narrow(bs)
    for name, values in expected_columns(batch, bs).items():
        got = getattr(view, name)
        assert got.tolist() == pytest.approx(values), f"{name}: {got.tolist()} != {values}"


@pytest.mark.parametrize(
    "batch, bs, match",
    [
        (HostBatch(slots=[1, 2], params=[SamplingParams()]), 2, "sampling params"),
        (batch_of([1, 2, 3]), 2, "cannot load into a bucket of 2"),
        (batch_of([1]), MAX_BATCH + 1, "max_batch"),
    ],
    ids=["params-count", "batch-over-bucket", "bucket-over-max-batch"],
)
def test_bad_batch_raises_and_changes_nothing(batch, bs, match):
    """A malformed batch raises ValueError naming the problem, before any buffer is touched.
    If this failed, a scheduler bug would run a graph over half-loaded inputs."""
    inputs = DecodeInputs(MAX_BATCH, "cpu")
    inputs.load(batch_of([4, 5, 6]), 4)
    before = [t.clone() for t in inputs.buffers]
    with pytest.raises(ValueError, match=match):
        inputs.load(batch, bs)
    for name, old, new in zip(inputs.buffers._fields, before, inputs.buffers):
        assert torch.equal(old, new), f"{name} changed by a rejected load"


def test_narrow_views_alias_the_buffers():
    """`narrow(bs)` gives [:bs] views of the static buffers, not copies. If this failed, a
    graph captured on a view would never see the inputs loaded later."""
    inputs = DecodeInputs(MAX_BATCH, "cpu")
    for bs in (1, 3, MAX_BATCH):
        view = inputs.narrow(bs)
        for name, full, part in zip(inputs.buffers._fields, inputs.buffers, view):
            assert part.shape == (bs,), name
            assert part.data_ptr() == full.data_ptr(), f"{name}[:{bs}] is not a view"
    inputs.load(batch_of([9, 4]), 2)
    assert inputs.narrow(2).slots.tolist() == [9, 4]  # a view taken before the load sees it
    view = inputs.narrow(4)
    view.seeds[3] = 77
    assert inputs.buffers.seeds[3] == 77


def test_addresses_stable_across_loads():
    """Loads write into the same memory every time. If this failed, every graph captured
    before a load would read freed or stale memory."""
    inputs = DecodeInputs(MAX_BATCH, "cpu")
    addresses = [t.data_ptr() for t in inputs.buffers]
    for n, bs in [(1, 1), (5, 8), (0, 2), (8, 8), (2, 3)]:
        inputs.load(batch_of(list(range(1, n + 1))), bs)
        assert [t.data_ptr() for t in inputs.buffers] == addresses
        assert [t.data_ptr() for t in inputs.narrow(bs)] == addresses
