"""The controls' device math against hand-written references: penalties (OpenAI frequency /
presence, HF repetition, also against transformers' processor), logit_bias, min_tokens, the
grammar mask and state advance, logprobs; and the Triton kernels against the torch reference."""

from __future__ import annotations

import math

import pytest
import torch

from graphrelay.capture.iteration.controls.apply import apply_triton
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig, SamplingControls
from graphrelay.capture.iteration.step import span_values_per_row

VOCAB = 70  # not a multiple of 32: the bitmask's last word is partial


def controls(backend="torch", **config) -> SamplingControls:
    return SamplingControls(ControlsConfig(backend=backend, max_bias=4, max_stop=2, **config), max_reqs=4,
                            vocab_size=VOCAB, max_rows=6, device="cpu")


def run_apply(c: SamplingControls, logits, slots, steps=None):
    slots = torch.tensor(slots)
    steps = torch.tensor(steps if steps is not None else [100] * len(slots))
    return c.apply(logits, slots, steps, c.row_states(slots)).clone()


def naive_penalties(logits_row, prompt, generated, freq, pres, rep):
    out = logits_row.clone()
    for t in range(len(out)):
        n = generated.count(t)
        x = out[t].item()
        if t in prompt or n:
            x = x / rep if x > 0 else x * rep
        out[t] = x - freq * n - (pres if n else 0.0)
    return out


def test_penalties_equal_a_hand_written_loop():
    torch.manual_seed(0)
    c = controls()
    prompt, generated = [3, 5, 5, 9], [5, 7, 7, 7, 11]
    c.admit(2, ControlParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.3), (), prompt)
    for t in generated:
        c.observe(torch.tensor([2]), torch.tensor([t]), c.row_states(torch.tensor([2])))
    logits = torch.randn(2, VOCAB) * 3
    got = run_apply(c, logits, [2, 0])
    want = naive_penalties(logits[0], prompt, generated, 0.5, 0.25, 1.3)
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], logits[1])  # padding row: untouched
    assert not torch.equal(got[0], logits[0])  # the control acts


def test_repetition_equals_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(1)
    c = controls()
    seq = [4, 8, 8, 15, 16, 23]
    c.admit(1, ControlParams(repetition_penalty=1.7), (), seq[:3])
    for t in seq[3:]:
        c.observe(torch.tensor([1]), torch.tensor([t]), c.row_states(torch.tensor([1])))
    logits = torch.randn(1, VOCAB) * 4
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seq]), logits.clone())
    torch.testing.assert_close(run_apply(c, logits, [1]), want)


def test_logit_bias_forces_a_token_and_min_tokens_masks_stops_until_reached():
    c = controls()
    logits = torch.zeros(3, VOCAB)
    logits[:, 3] = 5.0  # the model's favourite, and a stop token
    prompt = [1, 2, 3, 4]  # first sampled step = 3
    c.admit(1, ControlParams(logit_bias={42: 100.0, 3: -1.0}), (), prompt)
    c.admit(2, ControlParams(min_tokens=2), (3, 7), prompt)
    assert run_apply(c, logits[:1], [1])[0].argmax() == 42
    assert run_apply(c, logits[:1], [1])[0, 3] == 4.0
    masked = run_apply(c, logits, [2, 2, 2], steps=[3, 4, 5])
    assert math.isinf(masked[0, 3]) and math.isinf(masked[0, 7]) and math.isinf(masked[1, 3])
    assert masked[2, 3] == 5.0  # two tokens generated: stops allowed again


def test_bad_params_raise_before_any_state_changes():
    c = controls()
    c.admit(1, ControlParams(frequency_penalty=1.0), (), [1])
    before = [t.clone() for t in c.tables]
    with pytest.raises(ValueError, match="max_bias = 4"):
        c.admit(1, ControlParams(logit_bias={i: 1.0 for i in range(5)}), (), [1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        c.admit(1, ControlParams(logit_bias={VOCAB: 1.0}), (), [1])
    with pytest.raises(ValueError, match="max_stop = 2"):
        c.admit(1, ControlParams(min_tokens=1), (1, 2, 3), [1])
    assert all(torch.equal(a, b) for a, b in zip(before, c.tables))
    with pytest.raises(ValueError, match="repetition_penalty"):
        ControlParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="logprobs"):
        ControlParams(logprobs=21)
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        ControlParams(min_tokens=2, regex="a+")
    with pytest.raises(ValueError, match="not both"):
        ControlParams(json_schema="{}", regex="a")


def test_observe_advances_the_grammar_state_and_span_states_follow_drafts():
    c = controls()
    # A two-state automaton by hand in pool rows 1..2: row 1 allows only token 5 (-> row 2);
    # row 2 allows only 6 and 7 (stays).
    c.grammar.allowed[1] = 0
    c.grammar.allowed[1, 0] = 1 << 5
    c.grammar.allowed[2] = 0
    c.grammar.allowed[2, 0] = (1 << 6) | (1 << 7)
    c.grammar.next[1, 5] = 2
    c.grammar.next[2] = 2
    c.slot_state[3] = 1
    logits = torch.randn(1, VOCAB)
    out = run_apply(c, logits, [3])
    assert out[0].isfinite().nonzero().flatten().tolist() == [5]
    c.observe(torch.tensor([3]), torch.tensor([5]), c.row_states(torch.tensor([3])))
    assert int(c.slot_state[3]) == 2
    assert run_apply(c, logits, [3])[0].isfinite().nonzero().flatten().tolist() == [6, 7]
    c.slot_state[3] = 1
    rows, _ = c.span_rows(torch.tensor([3]), torch.tensor([[5, 6]]))
    assert rows.tolist() == [1, 2, 2]
    # A verify span of 3 rows with 2 accepted: the state is the one after the second.
    c.observe(torch.tensor([3, 3, 3]), torch.tensor([5, 6, 9]), rows, emitted=torch.tensor([True, True, False]))
    assert int(c.slot_state[3]) == 2
    assert int(c.tables.counts[3, 5]) == 2 and int(c.tables.counts[3, 6]) == 1 and int(c.tables.counts[3, 9]) == 0


def test_rows_not_emitted_may_carry_any_token_and_state_and_change_nothing():
    """A padding row's sampled id is whatever its logits gave (garbage under a bucket's padding):
    observing it must neither index outside the tables nor move any count or state."""
    c = controls()
    c.slot_state[2] = 1
    c.observe(torch.tensor([2]), torch.tensor([4]), c.row_states(torch.tensor([2])))
    counts, states = c.tables.counts.clone(), c.slot_state.clone()
    wild = torch.tensor([VOCAB + 9, -3, 2**40])
    c.observe(torch.tensor([0, 0, 2]), wild, torch.tensor([10**6, -5, 10**7]), emitted=torch.tensor([False, False, False]))
    assert torch.equal(c.tables.counts, counts)
    assert torch.equal(c.slot_state[: c.max_reqs + 1], states[: c.max_reqs + 1])


def test_logprobs_equal_log_softmax_topk():
    torch.manual_seed(2)
    c = controls()
    for slot in (1, 2):  # admitted asking: only such slots' rows are read
        c.admit(slot, ControlParams(logprobs=20), (), [3])
    logits = torch.randn(3, VOCAB) * 2
    tokens = torch.tensor([4, 0, 69])
    slots = torch.tensor([1, 0, 2])
    c.write_logprobs(slots, logits, tokens, torch.zeros(1, dtype=torch.int64))  # mirror iteration 0
    from graphrelay.mirror import MirrorRead

    read = MirrorRead(iteration=0, slots=torch.tensor([1, 2]), generation=torch.zeros(2, dtype=torch.int64),
                      tokens=torch.tensor([4, 69]), seq_lens=torch.zeros(2), stale=torch.zeros(2, dtype=torch.bool))
    rows = c.logprobs.read(read)
    ref = torch.log_softmax(logits, -1)
    for row, r in zip(rows, (0, 2)):
        assert row.logprob == pytest.approx(float(ref[r, tokens[r]]), rel=1e-3)
        top = ref[r].topk(20)
        assert [t for t, _ in row.top] == top.indices.tolist()
        assert [v for _, v in row.top] == pytest.approx(top.values.tolist(), rel=1e-3)


def random_controls(backend):
    torch.manual_seed(3)
    c = controls(backend)
    c.admit(1, ControlParams(frequency_penalty=0.7, presence_penalty=-0.3, repetition_penalty=0.8,
                             logit_bias={1: 3.0, 69: -2.0}, min_tokens=3), (2, 64), [5, 6, 7, 7])
    c.admit(2, ControlParams(repetition_penalty=1.5, logit_bias={33: 10.0}), (), [33, 40])
    for t in [9, 9, 64, 2]:
        c.observe(torch.tensor([1, 2]), torch.tensor([t, t + 1]), c.row_states(torch.tensor([1, 2])))
    c.grammar.allowed[1] = torch.randint(-(2**31), 2**31 - 1, (3,), dtype=torch.int32)
    c.slot_state[2] = 1
    return c


def test_triton_kernels_equal_the_torch_reference():
    logits = torch.randn(5, VOCAB) * 3
    slots, steps = [1, 2, 0, 1, 2], [4, 6, 0, 9, 7]
    want = run_apply(random_controls("torch"), logits, slots, steps)
    got = run_apply(random_controls("triton"), logits, slots, steps)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isinf(want).any() and not torch.equal(want, logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_are_controlled_as_their_float32_values(dtype):
    """The step hands the controls the LM head's own 16-bit output: both backends give what
    they give for its exact float32 widening, bit for bit."""
    logits = (torch.randn(5, VOCAB) * 3).to(dtype)
    slots, steps = [1, 2, 0, 1, 2], [4, 6, 0, 9, 7]
    for backend in ("torch", "triton"):
        want = run_apply(random_controls(backend), logits.float(), slots, steps)
        got = run_apply(random_controls(backend), logits, slots, steps)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_verify_span_row_sees_what_plain_decoding_would_after_its_drafts(backend):
    """Row j of a span, with drafts 0..j-1 counted and the automaton advanced past them, gets
    the logits a single row gets once those drafts were observed."""
    torch.manual_seed(4)
    params = ControlParams(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.4, min_tokens=2)
    span, plain = controls(backend), controls(backend)
    for c in (span, plain):
        c.admit(1, params, (9,), [3, 4])  # first sampled step 1: stop 9 masked at steps 1, 2
    drafts = torch.tensor([[9, 12, 9]])
    logits = torch.randn(4, VOCAB)
    states, row_drafts = span.span_rows(torch.tensor([1]), drafts)
    got = span.apply(logits, torch.tensor([1] * 4), torch.arange(1, 5), states, row_drafts).clone()
    for j in range(4):
        one = torch.tensor([1])
        want = plain.apply(logits[j : j + 1], one, torch.tensor([1 + j]), plain.row_states(one)).clone()
        torch.testing.assert_close(got[j : j + 1], want)
        if j < 3:
            plain.observe(one, drafts[:, j], plain.row_states(one))
    assert not torch.equal(got[0], got[3])


def test_observe_prompt_marks_what_admit_marks():
    """The capturable prompt path (a step that stages prompt tokens itself) equals admit's."""
    staged, admitted = controls(), controls()
    params = ControlParams(repetition_penalty=2.0)
    staged.admit(2, params, (), [])
    admitted.admit(2, params, (), [4, 8, 8, 60])
    staged.observe_prompt(torch.tensor([2, 2, 0, 2, 2]), torch.tensor([4, 8, 1, 8, 60]))  # 0: a padding token
    assert torch.equal(staged.tables.counts[2], admitted.tables.counts[2])
    assert int(staged.tables.counts[2].ne(0).sum()) == 3


def test_triton_apply_refuses_a_broadcast_row_tensor_before_launching():
    """A one-span verify batch once handed the kernel a stride-0 view of its slot (expand +
    reshape): the launch read four rows past it, an illegal address on the H200."""
    c = random_controls("triton")
    logits, out = torch.randn(5, VOCAB), c.logits_out[:5]
    before = out.clone()
    slots = torch.tensor([2]).expand(5)  # stride 0
    with pytest.raises(ValueError, match="row_slots must be \\[5\\] with unit stride"):
        apply_triton(c.tables, logits, slots, torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.int32), out)
    assert torch.equal(out, before)


@pytest.mark.parametrize("spans,per", [(1, 5), (1, 1), (3, 5), (4, 1)])
def test_span_values_per_row_are_contiguous_copies_request_major(spans, per):
    t = torch.arange(10, 20)
    rows = span_values_per_row(t, spans, per)
    assert rows.is_contiguous() and rows.stride() == (1,)
    assert rows.tolist() == [10 + i for i in range(spans) for _ in range(per)]


def test_triton_copies_rows_whose_controls_leave_the_logits_as_they_are_bit_for_bit():
    """The dense launch copies a row with no penalty, the all-allowed automaton state and
    min_tokens reached (a request asking only for logprobs, or padding) instead of applying
    the steps; each control's row is still applied, min_tokens until its step is reached."""
    c = controls("triton")
    ref = controls("torch")
    for k in (c, ref):
        k.admit(1, ControlParams(logprobs=1), (5,), [2, 3])
        k.admit(2, ControlParams(min_tokens=3), (5,), [2, 3])  # stop token 5 masked below step 4
        k.admit(3, ControlParams(repetition_penalty=1.5), (5,), [2, 3])  # prompt tokens 2 and 3
    logits = torch.randn(6, VOCAB) * 3
    logits[:, 7] = -0.0
    logits[0, 9] = float("nan")
    slots, steps = [1, 2, 2, 3, 0, 1], [4, 3, 4, 4, 0, 1]
    got, want = run_apply(c, logits, slots, steps), run_apply(ref, logits, slots, steps)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    for row in (0, 2, 4, 5):  # slot 1, slot 2 at its min_tokens step, padding
        assert torch.equal(got[row].view(torch.int32), logits[row].view(torch.int32))
    assert got[1, 5] == float("-inf") and got[2, 5] == logits[2, 5]
    assert not torch.equal(got[3, 2:4], logits[3, 2:4]) and torch.equal(got[3, 4:], logits[3, 4:])  # the penalty acted
