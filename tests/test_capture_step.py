"""The decode step run eagerly on the CPU (the same code a CUDA graph captures) against the slow
reference model: greedy tokens over many steps while requests join and leave and the padding
changes, padding that never changes a real request's result, and an empty batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from graphrelay.capture.model.model import LlamaModel
from model_reference import reference_logits
from graphrelay.capture.iteration.step import DecodeStep
from graphrelay.capture.iteration.surface import DecodeInputs
from capture_cases import MODEL, Driver, build_stack, composition_schedule
from graphrelay import Relay, RelayConfig
from graphrelay.mirror import HostMirror

MAX_REQS, MAX_BATCH = 10, 8
STEPS = 14
# Step and reference sum in different orders; their logits agree to ~1e-6, so a greedy pick
# may only differ from the reference's where its top two logits are closer than this.
TIE = 1e-4


def check_against_reference(driver: Driver, seqs: dict[int, list[int]], iteration: int, n: int) -> None:
    """The iteration's tokens, seq lens and logits against `reference_logits` of each sequence,
    then extend the sequences with the tokens."""
    read = driver.read(iteration)
    step = driver.stack.step
    assert read.slots.tolist() == step.inputs.buffers.slots[:n].tolist(), "mirror rows are not the batch rows"
    for row, (slot, token, seq_len) in enumerate(zip(read.slots.tolist(), read.tokens.tolist(), read.seq_lens.tolist())):
        seq = seqs[slot]
        where = f"iteration {iteration}, slot {slot} (batch row {row}, {len(seq)} tokens)"
        # The step consumed seq[-1] at position len(seq) - 1 and cached it.
        assert seq_len == len(seq), f"{where}: new seq len {seq_len}, expected {len(seq)}"
        ref = reference_logits(driver.stack.model, seq)  # [vocab]
        got = step.logits[row]
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), \
            f"{where}: logits differ from the reference by {(got - ref).abs().max():.2e}"
        top2 = ref.topk(2).values
        if token != int(ref.argmax()):
            assert float(top2[0] - top2[1]) < TIE and float(ref[token]) >= float(top2[1]), \
                f"{where}: sampled {token}, reference argmax {int(ref.argmax())}"
        seq.append(token)


@pytest.mark.parametrize("buckets", [[1, 2, 4, 8], [8]], ids=["dense-buckets", "one-bucket"])
def test_eager_step_agrees_with_reference(buckets):
    """Requests join and leave every step, batches are padded to buckets (a little with dense
    buckets, up to 7 rows with one bucket of 8). If this failed, the decode step an engine
    captures (relay resolve -> model -> sample -> relay stash/publish -> mirror) would emit
    wrong tokens even before any graph is involved."""
    stack = build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, buckets=buckets)
    driver = Driver(stack)
    seqs: dict[int, list[int]] = {}
    padded_steps = 0
    for plan in composition_schedule(STEPS, MAX_REQS, MAX_BATCH, seed=3, sampled=False):
        for slot in plan.leave:
            driver.leave(slot)
            del seqs[slot]
        for slot, prompt, params in plan.join:
            seqs[slot] = prompt + [int(driver.join(slot, prompt, params))]
        ran = driver.launch(plan.batch)
        padded_steps += ran > len(plan.batch)
        check_against_reference(driver, seqs, driver.iteration - 1, len(plan.batch))
    assert padded_steps >= 3, "the schedule must exercise padded buckets"


def test_padding_amount_does_not_change_tokens():
    """The same requests decoded with no padding (a bucket per size) and with heavy padding
    (one bucket of 8) give the same tokens and seq lens. If this failed, a request's output
    would depend on how many other requests happen to share its iteration."""
    exact = Driver(build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, buckets=list(range(1, MAX_BATCH + 1))))
    padded = Driver(build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, buckets=[MAX_BATCH]))
    for plan in composition_schedule(STEPS, MAX_REQS, MAX_BATCH, seed=5, sampled=True):
        sizes = [d.apply(plan) for d in (exact, padded)]
        assert sizes == [len(plan.batch) or 1, MAX_BATCH]
        a, b = (d.read(d.iteration - 1) for d in (exact, padded))
        for name in ("slots", "tokens", "seq_lens", "generation"):
            assert torch.equal(getattr(a, name), getattr(b, name)), \
                f"iteration {a.iteration}: {name} {getattr(a, name).tolist()} vs {getattr(b, name).tolist()}"
    rows = slice(1, None)  # request rows; row 0 is the padding row
    for name in exact.stack.relay.buffers:
        assert torch.equal(exact.stack.relay.buffers[name][rows], padded.stack.relay.buffers[name][rows]), name


def test_empty_batch_is_a_bucket_of_padding():
    """An empty batch runs the smallest bucket with one padding row and changes no request row.
    If this failed, an idle iteration in an engine would corrupt a paused request's state."""
    stack = build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, buckets=[1, 2, 4, 8])
    driver = Driver(stack)
    driver.join(3, [5, 6, 7])
    before = {name: t.clone() for name, t in stack.relay.buffers.items()}
    kv_before = stack.model.kv_cache.keys[0][1:].clone()
    assert driver.launch([]) == 1
    read = driver.read(0)
    assert len(read) == 0
    for name, t in stack.relay.buffers.items():
        assert torch.equal(t, before[name]), f"relay.{name} changed on an empty batch"
    assert torch.equal(stack.model.kv_cache.keys[0][1:], kv_before), "an empty batch wrote a request's KV rows"


def test_oversized_batch_runs_eagerly_and_agrees_with_reference():
    """A batch above the largest bucket runs eagerly at its own size, with one warning, and
    still decodes correctly. If this failed, a burst of requests beyond the captured buckets
    would crash or corrupt the engine instead of merely running slower."""
    stack = build_stack("cpu", max_reqs=MAX_REQS, max_batch=MAX_BATCH, buckets=[1, 2, 4])
    driver = Driver(stack)
    seqs = {}
    for slot in range(1, 7):
        prompt = [slot * 7 % MODEL.vocab_size, slot]
        seqs[slot] = prompt + [int(driver.join(slot, prompt))]
    batch = [6, 2, 4, 1, 5, 3]
    with pytest.warns(UserWarning, match="exceeds the largest bucket"):
        assert driver.launch(batch) == 6
    check_against_reference(driver, seqs, 0, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second oversized batch is silent
        assert driver.launch(batch) == 6
    check_against_reference(driver, seqs, 1, 6)


def test_step_rejects_mismatched_parts():
    """DecodeStep refuses parts sized for different engines. If this failed, a mismatch would
    surface as an out-of-bounds index inside a captured graph instead of a clear error."""
    cfg = RelayConfig.plain(4, 4)
    relay = Relay(cfg, "cpu", validate=False)
    mirror = HostMirror(relay, validate=False)
    with pytest.raises(ValueError, match="max_batch"):
        DecodeStep(relay, LlamaModel(MODEL, 4, "cpu"), mirror, DecodeInputs(8, "cpu"))
    with pytest.raises(ValueError, match="max_reqs"):
        DecodeStep(relay, LlamaModel(MODEL, 5, "cpu"), mirror, DecodeInputs(4, "cpu"))
