"""The fused iteration prologue (one Triton launch, interpreted here) against the glue it replaces
(relay resolve, on the relay's torch and Triton backends, and a dozen torch ops), bit for bit,
over random iterations: decode, verify and prompt-chunk spans in any order, padding tokens and
spans, decode positions up to the end of the cache (verify rows past it), relays storing int32
or int64, float32 and bfloat16 embeddings."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrelay import Relay, RelayConfig
from graphrelay.capture.iteration.inputs import IterationInputs
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.iteration.spans import decode_span, prefill_span
from graphrelay.capture.kernels.iteration_prologue import IterationPrologue
from relay_cases import bits

MAX_REQS, MAX_TOKENS, MAX_SPANS = 9, 24, 6
VOCAB, HIDDEN, MAX_SEQ_LEN = 50, 24, 32  # HIDDEN not a power of two: the row load is masked


def build(per: int, token_dtype: str, seq_len_dtype: str, relay_backend: str, seed: int, device: str = "cpu"):
    """A relay whose rows hold random tokens and seq lens (a third of them at the cache's end)."""
    config = RelayConfig(max_reqs=MAX_REQS, max_batch=MAX_SPANS * per, token_dtype=token_dtype,
                         pad_token_id=3, seq_len_dtype=seq_len_dtype, seq_len_fill=1)
    relay = Relay(config, device, backend=relay_backend, validate=False)
    gen = torch.Generator().manual_seed(seed)
    relay.buffers["tokens"][1:] = torch.randint(0, VOCAB, (MAX_REQS,), generator=gen)
    near_end = torch.randint(MAX_SEQ_LEN - 3, MAX_SEQ_LEN, (MAX_REQS,), generator=gen)
    anywhere = torch.randint(0, MAX_SEQ_LEN, (MAX_REQS,), generator=gen)
    relay.buffers["seq_lens"][1:] = torch.where(torch.rand(MAX_REQS, generator=gen) < 0.33, near_end, anywhere)
    return relay


def random_spans(rng: random.Random, per: int, bucket: int):
    """Spans of distinct slots filling at most `bucket` tokens and the bucket's span count."""
    spans, used = [], 0
    slots = rng.sample(range(1, MAX_REQS + 1), MAX_REQS)
    spans_cap = min(bucket, MAX_SPANS)
    while len(spans) < spans_cap and slots:
        if rng.random() < 0.5 and used + per <= bucket:
            spans.append(decode_span(slots.pop(), SamplingParams()))
            used += per
        elif used < bucket:
            n = rng.randint(1, min(bucket - used, 6))
            start = rng.randint(0, MAX_SEQ_LEN - n)
            spans.append(prefill_span(slots.pop(), SamplingParams(), [rng.randrange(VOCAB) for _ in range(n)],
                                      start, rng.random() < 0.5))
            used += n
        else:
            break
    return spans


def run(backend: str, relay: Relay, embed: torch.Tensor, per: int, spans, bucket: int, embeds: bool):
    """The prologue over freshly loaded inputs: its outputs for the bucket and the ids after it
    (on the relay's device; the embedding table must be there too)."""
    inputs = IterationInputs(MAX_TOKENS, MAX_SPANS, per, relay.device)
    inputs.load(spans, bucket, per)
    top = inputs.geometry(MAX_TOKENS)
    prologue = IterationPrologue(relay, embed, MAX_SEQ_LEN, top, embeds=embeds, backend=backend)
    g = inputs.geometry(bucket)
    placed = prologue(inputs.narrow(bucket), g)
    state = {name: t.clone() for name, t in placed._asdict().items() if t is not None}
    # The padding span's seq len is never written (nor read): compare the spans' only.
    state["seq_lens"] = state["seq_lens"][: g.spans]
    state["ids"] = inputs.buffers.ids[:bucket].clone()
    return state


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), per=st.sampled_from([1, 3]), bucket=st.integers(1, MAX_TOKENS),
       token_dtype=st.sampled_from(["int32", "int64"]), seq_len_dtype=st.sampled_from(["int32", "int64"]),
       relay_backend=st.sampled_from(["torch", "triton"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       embeds=st.booleans())
def test_fused_prologue_equals_the_glue(seed, per, bucket, token_dtype, seq_len_dtype, relay_backend, dtype, embeds):
    """Every buffer the prologue writes (seq lens, bases, positions, slots, row positions, the
    ids with the relay's tokens in, the embedding rows) equals the glue's bit for bit. If this
    failed, the captured step would feed the model different tokens or positions on the GPU
    than the reference path computes."""
    rng = random.Random(seed)
    spans = random_spans(rng, per, bucket)
    embed = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)
    glue_relay = build(per, token_dtype, seq_len_dtype, relay_backend, seed)
    fused_relay = build(per, token_dtype, seq_len_dtype, relay_backend, seed)
    want = run("torch", glue_relay, embed, per, spans, bucket, embeds)
    got = run("triton", fused_relay, embed, per, spans, bucket, embeds)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(bits(got[name]), bits(want[name])), \
            f"{name} differs: fused {got[name].tolist()} vs glue {want[name].tolist()} (spans {spans})"
    for name, buf in glue_relay.buffers.items():
        assert torch.equal(buf, fused_relay.buffers[name]), f"the prologue changed relay.{name}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verify_rows_past_the_cache_move_to_padding(backend):
    """A verify span of 3 tokens whose relay seq len is the cache's last position: its first
    token sits there with the relay's token; the two drafts after it are clamped to the last
    position and moved to slot 0. A prompt chunk keeps its staged start and ids, and padding
    tokens sit at slot 0, position 0."""
    relay = build(3, "int32", "int32", "torch", seed=0)
    relay.buffers["seq_lens"][4] = MAX_SEQ_LEN - 1
    relay.buffers["tokens"][4] = 17
    spans = [decode_span(4, SamplingParams()), prefill_span(2, SamplingParams(), [5, 6], 10, True)]
    embed = torch.arange(VOCAB * HIDDEN, dtype=torch.float32).view(VOCAB, HIDDEN)
    got = run(backend, relay, embed, 3, spans, 8, embeds=True)
    last = MAX_SEQ_LEN - 1
    assert got["positions"].tolist() == [last, last, last, 10, 11, 0, 0, 0]
    assert got["slots"].tolist() == [4, 0, 0, 2, 2, 0, 0, 0]
    assert got["ids"][[0, 3, 4]].tolist() == [17, 5, 6]
    assert got["base"][:2].tolist() == [last, 10] and got["seq_lens"][1].item() == 1  # a chunk reads the fill
    assert torch.equal(got["embedded"][0], embed[17]) and torch.equal(got["embedded"][3], embed[5])
    # Rows sample after each verify token and after the chunk's last token.
    assert got["row_positions"].tolist()[:4] == [last, last, last, 11]


def test_triton_prologue_refuses_a_debug_relay():
    relay = Relay(RelayConfig(max_reqs=MAX_REQS, max_batch=MAX_SPANS, debug=True), "cpu", validate=False)
    inputs = IterationInputs(MAX_TOKENS, MAX_SPANS, 1, "cpu")
    embed = torch.zeros(VOCAB, HIDDEN)
    with pytest.raises(ValueError, match="debug"):
        IterationPrologue(relay, embed, MAX_SEQ_LEN, inputs.geometry(MAX_TOKENS), embeds=True, backend="triton")
    default = IterationPrologue(relay, embed, MAX_SEQ_LEN, inputs.geometry(MAX_TOKENS), embeds=True)
    assert default.backend == "torch"
