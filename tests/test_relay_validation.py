"""Every bad input gets a clear error naming the problem, and leaves the relay unchanged."""

from __future__ import annotations

import msgspec
import pytest
import torch

from graphrelay import Relay, RelayPayload
from relay_cases import assert_same_state, full_config, random_payload, random_publish, snapshot

CONFIG = full_config(max_reqs=8, max_batch=4)


@pytest.fixture(params=["torch", "triton"])
def relay(request):
    relay = Relay(CONFIG, backend=request.param)
    relay.admit([1, 2, 3])
    gen = torch.Generator().manual_seed(1)
    idx = torch.tensor([1, 2, 3, 0])
    relay.stash_and_publish(idx, random_payload(relay, 4, gen), *random_publish(relay, 4, gen))
    return relay


def good_inputs(relay):
    gen = torch.Generator().manual_seed(2)
    payload = random_payload(relay, 2, gen)
    seq_lens, confidence = random_publish(relay, 2, gen)
    return torch.tensor([1, 0]), payload, seq_lens, confidence


BAD_INDICES = [
    ([1, 9], IndexError, "out of range"),
    ([-1, 1], IndexError, "out of range"),
    ([2, 2], ValueError, "more than once"),
    ([], ValueError, "pad an empty batch"),
    ([1, 2, 3, 4, 5], ValueError, "max_batch=4"),
]


@pytest.mark.parametrize("values, error, message", BAD_INDICES)
@pytest.mark.parametrize("op", ["stash", "publish", "both", "resolve"])
def test_bad_indices_rejected_without_state_change(relay, op, values, error, message):
    _, payload, seq_lens, confidence = good_inputs(relay)
    n = len(values)
    gen = torch.Generator().manual_seed(3)
    if n:
        payload = random_payload(relay, n, gen)
        seq_lens, confidence = random_publish(relay, n, gen)
    idx = torch.tensor(values, dtype=torch.int64)
    before = snapshot(relay)
    with pytest.raises(error, match=message):
        {
            "stash": lambda: relay.stash(idx, payload),
            "publish": lambda: relay.publish(idx, seq_lens, confidence),
            "both": lambda: relay.stash_and_publish(idx, payload, seq_lens, confidence),
            "resolve": lambda: relay.resolve(idx),
        }[op]()
    assert_same_state(before, snapshot(relay))


def test_index_dtype_device_and_rank(relay):
    before = snapshot(relay)
    with pytest.raises(ValueError, match="int32 or torch.int64"):
        relay.resolve(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="1-D"):
        relay.resolve(torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="torch.Tensor"):
        relay.resolve([1, 0])
    with pytest.raises(ValueError, match="relay lives on"):
        relay.resolve(torch.tensor([1, 0], device="meta"))
    assert_same_state(before, snapshot(relay))


def test_payload_shape_dtype_and_missing_fields(relay):
    idx, payload, seq_lens, confidence = good_inputs(relay)
    before = snapshot(relay)
    cases = [
        (payload.__class__(**{**_fields(payload), "hidden": payload.hidden[:, :-1]}), "payload.hidden has shape"),
        (payload.__class__(**{**_fields(payload), "tokens": payload.tokens.float()}), "payload.tokens dtype"),
        (payload.__class__(**{**_fields(payload), "topk_p": payload.topk_p.double()}), "float64"),
        (payload.__class__(**{**_fields(payload), "hidden": None}), "payload.hidden is missing"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            relay.stash(idx, bad)
    with pytest.raises(ValueError, match="publish.seq_lens has shape"):
        relay.publish(idx, seq_lens[:1], confidence)
    with pytest.raises(ValueError, match="confidence is missing"):
        relay.publish(idx, seq_lens)
    with pytest.raises(ValueError, match="RelayPayload"):
        relay.stash(idx, {"tokens": payload.tokens})
    # stash_and_publish checks both halves before writing either.
    with pytest.raises(ValueError, match="publish.confidence has shape"):
        relay.stash_and_publish(idx, payload, seq_lens, confidence[:, :1])
    assert_same_state(before, snapshot(relay))


def test_undeclared_fields_rejected():
    relay = Relay(full_config(max_reqs=8, max_batch=4, hidden=None, confidence=None))
    before = snapshot(relay)
    gen = torch.Generator().manual_seed(0)
    payload = random_payload(relay, 2, gen)
    with pytest.raises(ValueError, match="payload.hidden is set but the RelayConfig does not declare it"):
        relay.stash(torch.tensor([1, 0]), RelayPayload(**{**_fields(payload), "hidden": torch.zeros(2, 4)}))
    with pytest.raises(ValueError, match="does not declare it"):
        relay.publish(torch.tensor([1, 0]), torch.ones(2, dtype=torch.int32), torch.zeros(2, 3))
    assert_same_state(before, snapshot(relay))


def test_bad_out_buffers_rejected(relay):
    before = snapshot(relay)
    out = relay.alloc_resolved(4)
    with pytest.raises(ValueError, match="out.tokens has shape"):
        relay.resolve(torch.tensor([1, 0]), out=out)  # bs 2 but out is [4]
    narrowed = out.narrow(2)
    with pytest.raises(ValueError, match="out.hidden dtype"):
        relay.resolve(torch.tensor([1, 0]), out=narrowed.__class__(**{**_fields(narrowed), "hidden": torch.zeros(2, 40, dtype=torch.int32)}))
    assert_same_state(before, snapshot(relay))


def test_admit_rejects_padding_out_of_range_and_duplicates(relay):
    before = snapshot(relay)
    with pytest.raises(IndexError, match="slot 0"):
        relay.admit([0])
    with pytest.raises(IndexError, match="out of range"):
        relay.admit([4, 9])
    with pytest.raises(ValueError, match="more than once"):
        relay.admit([4, 4])
    assert_same_state(before, snapshot(relay))
    relay.admit(torch.tensor([4, 5]))
    assert relay.generation.tolist() == relay.host_generation.tolist()
    assert relay.host_generation[[1, 4, 5, 6]].tolist() == [1, 1, 1, 0]


def _fields(struct) -> dict:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}


# ---- values that do not fit the relay's dtypes are rejected, not wrapped --------------------


def test_a_token_too_large_for_the_token_dtype_is_rejected(relay):
    idx, payload, seq_lens, confidence = good_inputs(relay)
    before = snapshot(relay)
    big = msgspec.structs.replace(payload, tokens=torch.tensor([2**40, 1]))  # int32 storage: would be 0
    with pytest.raises(ValueError, match=r"payload.tokens holds 1099511627776, which does not fit .*torch.int32.*RelayConfig.token_dtype"):
        relay.stash_and_publish(idx, big, seq_lens, confidence)
    assert_same_state(before, snapshot(relay))


def test_a_seq_len_too_large_for_the_seq_len_dtype_is_rejected(relay):
    idx, _, seq_lens, confidence = good_inputs(relay)
    before = snapshot(relay)
    with pytest.raises(ValueError, match=r"publish.seq_lens holds 1099511627779,.*RelayConfig.seq_len_dtype"):
        relay.publish(idx, torch.tensor([2**40 + 3, 4]), confidence)
    with pytest.raises(ValueError, match=r"payload.accepted_tokens holds -32769,.*RelayConfig.accepted_tokens.dtype"):
        relay.stash(idx, msgspec.structs.replace(good_inputs(relay)[1], accepted_tokens=torch.full((2, 3), -(2**15) - 1)))
    assert_same_state(before, snapshot(relay))


def test_values_in_range_of_a_wider_dtype_are_accepted(relay):
    idx, payload, _, confidence = good_inputs(relay)
    relay.publish(idx, torch.tensor([2**31 - 1, 0]), confidence)  # int64 source, fits int32
    assert relay.buffers["seq_lens"][1].item() == 2**31 - 1


def test_an_out_dtype_that_would_truncate_is_rejected(relay):
    before = snapshot(relay)
    out = relay.alloc_resolved(2)
    narrow = msgspec.structs.replace(out, tokens=torch.zeros(2, dtype=torch.int8))
    with pytest.raises(ValueError, match="out.tokens dtype torch.int8 cannot hold every torch.int32 value.*truncate"):
        relay.resolve(torch.tensor([1, 0]), out=narrow)
    with pytest.raises(ValueError, match="dtypes\\['seq_lens'\\] dtype torch.int16 cannot hold"):
        relay.alloc_resolved(2, dtypes={"seq_lens": torch.int16})
    assert_same_state(before, snapshot(relay))


@pytest.mark.parametrize(
    "slots, message",
    [
        ([1.0, 2.0], "slot 1.0 is not an int"),
        ([2.7], "slot 2.7 is not an int"),
        ([True], "slot True is a bool"),
        (torch.tensor([1.0, 2.0]), "1-D integer tensor, got a 1-D torch.float32"),
        (torch.tensor([True]), "torch.bool"),
        (torch.tensor([[1, 2]]), "got a 2-D torch.int64"),
        ([[1, 2]], "not an int \\(a list\\)"),
        (None, "sequence of ints"),
        (3, "sequence of ints"),
    ],
)
def test_admit_rejects_what_it_would_coerce(relay, slots, message):
    before = snapshot(relay)
    with pytest.raises(ValueError, match=message):
        relay.admit(slots)
    assert_same_state(before, snapshot(relay))


def test_validation_is_switched_per_block_not_by_assignment(relay):
    idx = torch.tensor([1, 9])  # 9 is out of range: host checks reject it
    assert relay.validate
    with pytest.raises(AttributeError):
        relay.validate = False
    with relay.validation(False):
        assert not relay.validate
        relay.resolve(idx)  # unchecked: the device clamps 9 to padding row 0
        with pytest.raises(RuntimeError):
            with relay.validation(True):
                assert relay.validate
                raise RuntimeError("the old setting comes back even on error")
        assert not relay.validate
    assert relay.validate
    with pytest.raises(IndexError, match="out of range"):
        relay.resolve(idx)
    with pytest.raises(ValueError, match="must be True or False"):
        relay.validation("off").__enter__()
    with pytest.raises(ValueError, match="validate=.*must be True or False"):
        Relay(CONFIG, validate="no")


def test_a_negative_seq_len_is_rejected(relay):
    idx, _, _, confidence = good_inputs(relay)
    before = snapshot(relay)
    with pytest.raises(ValueError, match=r"publish.seq_lens holds -5; sequence lengths must be >= 0"):
        relay.publish(idx, torch.tensor([-5, 4], dtype=torch.int32), confidence)
    assert_same_state(before, snapshot(relay))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch that has no CUDA device")
def test_a_cuda_relay_without_cuda_says_so():
    with pytest.raises(ValueError, match="device 'cuda': this torch sees no CUDA device .*use device='cpu'"):
        Relay(CONFIG, "cuda")
