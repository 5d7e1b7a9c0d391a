"""Debug mode: poisoned rows, consume-once and bounds are checked on the device, and
`check()` raises outside capture naming the slot and the field."""

from __future__ import annotations

import pytest
import torch

from graphrelay import Relay, RelayConfig, RelayDebugError, RelayPayload
from graphrelay import debug as codes


@pytest.fixture(params=["torch", "triton"])
def relay(request):
    relay = Relay(RelayConfig.plain(6, 4, debug=True), backend=request.param)
    relay.admit([1, 2, 3])
    return relay


def write(relay, slots, tokens, seq_lens):
    idx = torch.tensor(slots)
    relay.stash_and_publish(idx, RelayPayload(tokens=torch.tensor(tokens)), torch.tensor(seq_lens))


def expect_error(relay, code, slot, field):
    with pytest.raises(RelayDebugError) as info:
        relay.check()
    err = info.value
    assert (err.code, err.slot, err.field) == (code, slot, field)
    assert f" {slot} " in str(err)
    relay.check()  # the record was cleared


def test_written_then_read_once_is_clean(relay):
    write(relay, [1, 2, 0], [5, 6, 7], [3, 4, 9])
    out = relay.resolve(torch.tensor([2, 1, 0, 0]))
    relay.check()
    assert out.tokens.tolist() == [6, 5, 0, 0]


def test_double_consume_names_slot_and_field(relay):
    write(relay, [1, 2], [5, 6], [3, 4])
    relay.resolve(torch.tensor([1, 2]))
    relay.check()
    relay.resolve(torch.tensor([0, 2]))
    expect_error(relay, codes.ERR_CONSUMED, 2, "tokens")


def test_unpublished_read(relay):
    relay.stash(torch.tensor([3]), RelayPayload(tokens=torch.tensor([9])))
    relay.resolve(torch.tensor([3]))
    expect_error(relay, codes.ERR_UNWRITTEN, 3, "seq_lens")


def test_read_before_any_write_and_poisoned_values(relay):
    out = relay.resolve(torch.tensor([1, 0]))
    assert out.tokens[0].item() == -1 and out.seq_lens[0].item() == -1  # poisoned row
    assert out.tokens[1].item() == 0 and out.seq_lens[1].item() == 1  # padding fill values
    expect_error(relay, codes.ERR_UNWRITTEN, 1, "tokens")


def test_readmitted_slot_is_unwritten_again(relay):
    write(relay, [1], [5], [3])
    relay.admit([1])
    relay.resolve(torch.tensor([1]))
    expect_error(relay, codes.ERR_UNWRITTEN, 1, "tokens")


def test_out_of_range_index_is_recorded_and_clamped_to_padding(relay):
    write(relay, [1], [5], [3])
    with relay.validation(False):  # what happens inside a capture, where host checks are skipped
        out = relay.resolve(torch.tensor([1, 40]))
    assert out.tokens.tolist() == [5, 0]
    expect_error(relay, codes.ERR_OUT_OF_RANGE, 40, "indices")
    before = {name: buf.clone() for name, buf in relay.buffers.items()}
    with relay.validation(False):
        write(relay, [-3], [8], [8])
    expect_error(relay, codes.ERR_OUT_OF_RANGE, -3, "indices")
    for name, buf in relay.buffers.items():
        assert torch.equal(buf, before[name]), "an out-of-range scatter must write nothing"


def test_environment_switch_enables_debug(monkeypatch):
    monkeypatch.setenv("GRAPHRELAY_DEBUG", "1")
    relay = Relay(RelayConfig.plain(4, 2))
    assert relay.debug
    relay.resolve(torch.tensor([2]))
    with pytest.raises(RelayDebugError):
        relay.check()


def test_debug_off_records_nothing():
    relay = Relay(RelayConfig.plain(4, 2))
    relay.resolve(torch.tensor([2]))  # never written: fill values, no record
    relay.resolve(torch.tensor([2]))
    relay.check()
    assert relay._error.tolist() == [0, 0, 0, 0]
