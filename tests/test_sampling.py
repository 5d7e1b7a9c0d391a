"""capture.sampling: greedy, seeded temperature/top-k sampling that is reproducible, independent
of batch composition, stays inside the top-k set, and follows the softmax distribution."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.sampling import SamplingParams, gumbel_noise, hash32, pack_sampling_params, sample


def rows(n, temperature=1.0, top_k=0, seed=0, step=0):
    """[n] sampling tensors with every row the same."""
    return (
        torch.full((n,), temperature, dtype=torch.float32),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), seed, dtype=torch.int64),
        torch.full((n,), step, dtype=torch.int64),
    )


def random_logits(bs, vocab, seed=0):
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed))


def lowbias32(x: int) -> int:
    """Pure-Python lowbias32 with exact integer arithmetic, to check the overflow-free torch one."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash32_matches_exact_integer_reference():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF] + [
        int(v) for v in torch.randint(0, 2**32, (200,), generator=torch.Generator().manual_seed(1))
    ]
    assert hash32(torch.tensor(values)).tolist() == [lowbias32(v) for v in values]


def test_gumbel_noise_has_gumbel_moments():
    noise = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert torch.isfinite(noise).all()
    assert abs(float(noise.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(noise.std()) - 1.2825) < 0.01  # pi / sqrt(6)


def test_greedy_rows_equal_argmax_whatever_top_k():
    logits = random_logits(8, 100)
    temperature, _, seeds, steps = rows(8, temperature=0.0)
    top_k = torch.tensor([0, 1, 2, 5, 50, 100, 200, 3], dtype=torch.int32)
    assert torch.equal(sample(logits, temperature, top_k, seeds, steps), logits.argmax(-1))


def test_top_k_one_equals_greedy():
    logits = random_logits(16, 300)
    temperature, top_k, _, steps = rows(16, temperature=2.0, top_k=1)
    seeds = torch.arange(16)
    assert torch.equal(sample(logits, temperature, top_k, seeds, steps), logits.argmax(-1))


def test_mixed_batch_selects_greedy_per_row():
    logits = random_logits(4, 50, seed=3)
    temperature = torch.tensor([0.0, 5.0, 0.0, 5.0])
    _, top_k, seeds, steps = rows(4)
    tokens = sample(logits, temperature, top_k, seeds, steps)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_sampling_is_reproducible_and_varies_with_seed_and_step():
    logits = random_logits(1, 64).expand(200, 64).contiguous()
    temperature, top_k, _, _ = rows(200, temperature=1.0)
    by_step = sample(logits, temperature, top_k, torch.zeros(200, dtype=torch.int64), torch.arange(200))
    again = sample(logits, temperature, top_k, torch.zeros(200, dtype=torch.int64), torch.arange(200))
    assert torch.equal(by_step, again)
    assert len(set(by_step.tolist())) > 10
    # The high 32 bits of seed and step are used too, and negative seeds work.
    for seeds, steps in (
        (torch.full((200,), 2**32), torch.arange(200)),
        (torch.full((200,), -1), torch.arange(200)),
        (torch.zeros(200, dtype=torch.int64), torch.arange(200) + 2**40),
    ):
        assert not torch.equal(sample(logits, temperature, top_k, seeds, steps), by_step)


def test_sampling_is_independent_of_batch_position_and_neighbours():
    target_logits = random_logits(1, 128, seed=5)[0]
    target = (1.3, 20, 12345, 77)  # temperature, top_k, seed, step
    alone = sample(target_logits[None], *rows(1, *target))[0]
    for position, bs in ((0, 3), (4, 7), (8, 9)):
        logits = random_logits(bs, 128, seed=bs)
        logits[position] = target_logits
        temperature, top_k, seeds, steps = (torch.rand(bs) * 3, torch.randint(0, 50, (bs,), dtype=torch.int32),
                                            torch.randint(0, 1000, (bs,)), torch.randint(0, 1000, (bs,)))
        temperature[position], top_k[position], seeds[position], steps[position] = target
        assert sample(logits, temperature, top_k, seeds, steps)[position] == alone


@settings(max_examples=60, deadline=None)
@given(
    bs=st.integers(1, 6),
    vocab=st.integers(1, 40),
    data_seed=st.integers(0, 2**16),
    quantize=st.booleans(),
    data=st.data(),
)
def test_sampled_tokens_are_always_in_the_top_k_set(bs, vocab, data_seed, quantize, data):
    logits = random_logits(bs, vocab, seed=data_seed)
    if quantize:  # many ties: the k-th value's ties count as inside the top-k set
        logits = logits.round()
    temperature = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.1, 1.0, 10.0]), min_size=bs, max_size=bs)))
    top_k = torch.tensor(data.draw(st.lists(st.integers(0, vocab + 2), min_size=bs, max_size=bs)), dtype=torch.int32)
    seeds = torch.tensor(data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=bs, max_size=bs)))
    steps = torch.tensor(data.draw(st.lists(st.integers(0, 2**40), min_size=bs, max_size=bs)))
    max_top_k = data.draw(st.none() | st.integers(1, vocab + 2))

    tokens = sample(logits, temperature, top_k, seeds, steps, max_top_k=max_top_k)
    assert tokens.dtype == torch.int64 and tokens.shape == (bs,)
    for row in range(bs):
        k = int(top_k[row]) if 0 < int(top_k[row]) < vocab else vocab
        if k < vocab and max_top_k is not None:
            k = min(k, max_top_k)
        kth_largest = logits[row].sort(descending=True).values[k - 1]
        assert logits[row, tokens[row]] >= kth_largest
        if temperature[row] == 0:
            assert tokens[row] == logits[row].argmax()


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (2.0, 0), (0.5, 0), (1.0, 3)])
def test_sample_frequencies_follow_tempered_softmax(temperature, top_k):
    n = 6000
    logit_row = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    expected = torch.softmax(logit_row / temperature, dim=0)
    if top_k:
        expected[top_k:] = 0
        expected /= expected.sum()
    temperature_t, top_k_t, _, _ = rows(n, temperature=temperature, top_k=top_k)
    # Vary the step across rows for one seed, then the seed across rows for one step.
    for seeds, steps in ((torch.full((n,), 7), torch.arange(n)), (torch.arange(n), torch.full((n,), 7))):
        tokens = sample(logit_row.expand(n, 6).contiguous(), temperature_t, top_k_t, seeds, steps)
        frequencies = torch.bincount(tokens, minlength=6).float() / n
        # 4 standard deviations of a frequency at n = 6000 is below 0.026.
        assert (frequencies - expected).abs().max() < 0.026, (frequencies, expected)


def test_max_top_k_only_changes_rows_above_the_cap():
    bs = 64
    logits = random_logits(bs, 200, seed=9)
    temperature, _, _, _ = rows(bs, temperature=1.5)
    seeds, steps = torch.arange(bs), torch.arange(bs) * 3
    top_k = torch.tensor([0, 1, 4, 8, 200, 500] * 10 + [0] * 4, dtype=torch.int32)
    uncapped = sample(logits, temperature, top_k, seeds, steps)
    assert torch.equal(sample(logits, temperature, top_k, seeds, steps, max_top_k=8), uncapped)
    capped = sample(logits, temperature, torch.full((bs,), 100, dtype=torch.int32), seeds, steps, max_top_k=4)
    assert torch.equal(capped, sample(logits, temperature, torch.full((bs,), 4, dtype=torch.int32), seeds, steps))
    with pytest.raises(ValueError, match="max_top_k must be None or a positive int"):
        sample(logits, temperature, top_k, seeds, steps, max_top_k=0)


def test_out_buffer_receives_tokens():
    logits = random_logits(3, 20)
    out = torch.full((3,), -1, dtype=torch.int64)
    result = sample(logits, *rows(3, temperature=0.0), out=out)
    assert result.data_ptr() == out.data_ptr() and torch.equal(out, logits.argmax(-1))


def test_sample_rejects_bad_metadata():
    logits = random_logits(2, 10)
    temperature, top_k, seeds, steps = rows(2)
    with pytest.raises(ValueError, match="logits must be float32"):
        sample(logits.double(), temperature, top_k, seeds, steps)
    with pytest.raises(ValueError, match="temperature must be"):
        sample(logits, temperature.double(), top_k, seeds, steps)
    with pytest.raises(ValueError, match="top_k must be"):
        sample(logits, temperature, torch.zeros(3, dtype=torch.int32), seeds, steps)
    with pytest.raises(ValueError, match="steps must be"):
        sample(logits, temperature, top_k, seeds, steps.float())
    with pytest.raises(ValueError, match="out must be an int64"):
        sample(logits, temperature, top_k, seeds, steps, out=torch.empty(2, dtype=torch.int32))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_k": -1}, "top_k"), ({"seed": 2**63}, "seed")],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_pack_sampling_params_pads_with_greedy_rows():
    packed = pack_sampling_params([SamplingParams(0.7, 40, -3), SamplingParams(1.0, 0, 2**62)], 4)
    assert packed.temperature.tolist() == pytest.approx([0.7, 1.0, 0.0, 0.0])
    assert packed.top_k.dtype == torch.int32 and packed.top_k.tolist() == [40, 0, 0, 0]
    assert packed.seeds.dtype == torch.int64 and packed.seeds.tolist() == [-3, 2**62, 0, 0]
    with pytest.raises(ValueError, match="do not fit in a batch of 1"):
        pack_sampling_params([SamplingParams(), SamplingParams()], 1)
