"""capture.sampling: greedy, seeded temperature/top-k/top-p sampling that is reproducible,
independent of batch composition, keeps exactly the documented set, follows the softmax
distribution, and gives the same tokens from the torch reference and the fused Triton kernels
(run here by Triton's interpreter)."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from graphrelay.capture.iteration.sampling import SamplingParams, gumbel_noise, hash32, keep_threshold, pack_sampling_params, sample
from graphrelay.capture.kernels.sampling_kernel import _kth_largest, sample_triton, select_levels


def rows(n, temperature=1.0, top_k=0, seed=0, step=0):
    """[n] sampling tensors with every row the same."""
    return (torch.full((n,), temperature, dtype=torch.float32), torch.full((n,), top_k, dtype=torch.int32),
            torch.full((n,), seed, dtype=torch.int64), torch.full((n,), step, dtype=torch.int64))


def random_logits(bs, vocab, seed=0):
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed))


def mixed_params(bs, vocab, seed):
    """Per-row mix of greedy, temperature only, top-k, top-p, and top-k with top-p."""
    gen = torch.Generator().manual_seed(seed)
    kind = torch.arange(bs) % 5
    temperature = torch.where(kind == 0, 0.0, 0.2 + 2 * torch.rand(bs, generator=gen))
    top_k = torch.where((kind == 2) | (kind == 4), torch.randint(1, vocab + 5, (bs,), generator=gen), 0).int()
    top_p = torch.where(kind >= 3, 0.05 + 0.9 * torch.rand(bs, generator=gen), 1.0)
    seeds = torch.randint(-(2**62), 2**62, (bs,), generator=gen)
    steps = torch.randint(0, 2**40, (bs,), generator=gen)
    return temperature, top_k, top_p, seeds, steps


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


# ----------------------------------------------------------------------------------------------
# The Triton kernels against the torch reference


@pytest.mark.parametrize(
    "bs, vocab, max_top_k, chunk",
    [(8, 300, 8, 64), (5, 1000, 64, 128), (8, 700, 200, 64), (3, 257, 256, 4096), (4, 40, 16, 16), (37, 300, 8, 64)],
    ids=["small-width", "width-under-chunk", "width-over-chunk", "one-chunk", "vocab-under-width",
         "rows-over-a-pick-block"],
)
def test_triton_tokens_equal_torch(bs, vocab, max_top_k, chunk):
    """Same tokens over mixed rows and several steps, with the vocabulary cut into chunks
    smaller and larger than the ranked width. If this failed, the fused path would sample a
    different distribution, or a different token for the same (seed, step)."""
    logits = 2 * random_logits(bs, vocab, seed=vocab)
    logits[0, : vocab // 3] = float("-inf")  # masked logits (a greedy row, so its argmax is checked)
    logits[1, : vocab // 2] = float("-inf")  # and on a sampled row
    temperature, top_k, top_p, seeds, steps = mixed_params(bs, vocab, seed=bs)
    for step in range(3):
        reference = sample(logits, temperature, top_k, seeds, steps + step, max_top_k=max_top_k, top_p=top_p)
        out = torch.full((bs,), -1, dtype=torch.int64)
        fused = sample_triton(logits, temperature, top_k, top_p, seeds, steps + step, out, min(max_top_k, vocab),
                              chunk=chunk)
        assert torch.equal(fused, reference), f"step {step}: triton {fused.tolist()} != torch {reference.tolist()}"
    # Through `sample` (default chunk), without top_p, into a strided `out`:
    out = torch.full((bs, 2), -1, dtype=torch.int64)
    fused = sample(logits, temperature, top_k, seeds, steps, out=out[:, 1], max_top_k=max_top_k, backend="triton")
    assert torch.equal(fused, sample(logits, temperature, top_k, seeds, steps, max_top_k=max_top_k))
    assert (out[:, 0] == -1).all()


@settings(max_examples=25, deadline=None)
@given(
    bs=st.integers(1, 3),
    vocab=st.integers(1, 150),
    max_top_k=st.integers(1, 80),
    chunk=st.sampled_from([16, 64, 4096]),
    quantize=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    data_seed=st.integers(0, 2**16),
)
def test_triton_tokens_equal_torch_property(bs, vocab, max_top_k, chunk, quantize, dtype, data_seed):
    """Random shapes and parameters, with many tied logits when quantized. 16-bit logits (the
    engine samples a 16-bit model's LM head output as it is) give, in both backends, the tokens
    of their exact float32 widening."""
    logits = 3 * random_logits(bs, vocab, seed=data_seed)
    if quantize:
        logits = logits.round()
    logits = logits.to(dtype)
    temperature, top_k, top_p, seeds, steps = mixed_params(bs, vocab, seed=data_seed)
    reference = sample(logits.float(), temperature, top_k, seeds, steps, max_top_k=max_top_k, top_p=top_p)
    assert torch.equal(sample(logits, temperature, top_k, seeds, steps, max_top_k=max_top_k, top_p=top_p), reference)
    out = torch.empty(bs, dtype=torch.int64)
    fused = sample_triton(logits, temperature, top_k, top_p, seeds, steps, out, min(max_top_k, vocab), chunk=chunk)
    assert torch.equal(fused, reference)


# ----------------------------------------------------------------------------------------------
# Semantics


def python_kept(row: list[float], temperature: float, top_k: int, top_p: float, width: int) -> tuple[set, float]:
    """The kept token set per `sample`'s docstring, in plain Python float64, and the smallest
    distance between a cumulative probability and top_p (where float32 may decide otherwise)."""
    vocab = len(row)
    s = sorted(row, reverse=True)
    n = min(top_k, width) if 0 < top_k < vocab else vocab
    margin = math.inf
    if top_p < 1:
        weights = [math.exp((v - s[0]) / temperature) for v in s[:n]]
        total = sum(weights)
        cumulative, m = 0.0, min(n, width)
        for j, w in enumerate(weights[:width]):
            cumulative += w / total
            margin = min(margin, abs(cumulative - top_p))
            if cumulative >= top_p:
                m = min(m, j + 1)
                break
    else:
        m = n
    return {i for i, v in enumerate(row) if v >= s[m - 1]}, margin


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.integers(1, 60),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 70),
    top_p=st.floats(0.01, 1.0),
    width=st.integers(1, 70),
    quantize=st.booleans(),
    data_seed=st.integers(0, 2**16),
)
def test_keep_threshold_matches_python_definition(vocab, temperature, top_k, top_p, width, quantize, data_seed):
    """The reference's kept set (logits >= threshold) equals the docstring's definition computed
    independently, whenever no cumulative probability is within float32 reach of top_p."""
    logits = 2 * random_logits(1, vocab, seed=data_seed)
    if quantize:
        logits = (logits * 2).round() / 2
    top_p = float(torch.tensor(top_p, dtype=torch.float32))  # what the tensors hold (0.99999999 is 1)
    kept, margin = python_kept(logits[0].double().tolist(), temperature, top_k, top_p, min(width, vocab))
    assume(margin > 1e-4)
    threshold, top = keep_threshold(logits, torch.tensor([temperature]), torch.tensor([top_k]),
                                    torch.tensor([top_p]), min(width, vocab))
    assert top.item() == logits.max().item()
    assert {i for i in range(vocab) if logits[0, i] >= threshold[0, 0]} == kept


def test_top_p_keeps_the_smallest_prefix_reaching_it():
    """Hand-checked nucleus: probabilities 0.5, 0.25, 0.125, 0.0625, ... over distinct tokens.
    top_p 0.75 needs exactly the first two; 0.76 the first three; the top token always stays;
    with top_k 0 the nucleus is capped at max_top_k tokens."""
    probs = torch.tensor([0.5 ** (i + 1) for i in range(12)])
    logits = probs.log()[torch.tensor([5, 0, 3, 1, 2, 4, 6, 7, 8, 9, 10, 11])][None].float()  # shuffled
    order = logits[0].argsort(descending=True).tolist()

    def kept(top_p, top_k=0, width=12):
        threshold, _ = keep_threshold(logits, torch.tensor([1.0]), torch.tensor([top_k]), torch.tensor([top_p]), width)
        return {i for i in range(12) if logits[0, i] >= threshold[0, 0]}

    assert kept(0.75 - 1e-3) == set(order[:2])
    assert kept(0.76) == set(order[:3])
    assert kept(1e-6) == {order[0]}
    assert kept(0.999, width=4) == set(order[:4])  # capped at W = 4
    # "Reaches" includes equality: top_p equal to the top token's probability, as the reference
    # computes it in float32, keeps the top token alone.
    top_probability = 1 / torch.exp(logits - logits.max()).sum()
    assert kept(float(top_probability)) == {order[0]}
    assert kept(float(top_probability) * 1.001) == set(order[:2])
    # With top-k 2 the probabilities renormalise to 2/3, 1/3: 0.6 keeps one token, 0.7 both.
    assert kept(0.6, top_k=2) == {order[0]}
    assert kept(0.7, top_k=2) == set(order[:2])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_rows_equal_argmax_whatever_the_cuts(backend):
    """The first index among tied maxima, whatever top-k and top-p say."""
    logits = random_logits(8, 100)
    logits[0, [7, 30]] = 9.0
    logits[1, [0, 99]] = 9.0
    logits[2] = -1.0
    temperature, _, seeds, steps = rows(8, temperature=0.0)
    top_k = torch.tensor([0, 1, 2, 5, 50, 100, 200, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.1, 0.5, 0.9, 1.0, 0.01, 0.3, 1.0])
    tokens = sample(logits, temperature, top_k, seeds, steps, max_top_k=64, top_p=top_p, backend=backend)
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[:3].tolist() == [7, 0, 0]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_rows_of_nan_logits_still_give_ids_inside_the_vocabulary(temperature):
    """A padding row's logits may hold NaN (uninitialized memory upstream): its token is
    meaningless but must stay a valid id, since later kernels index tables by it. (Rows of
    NaN only: tests/gpu/test_sampling_gpu.py; the interpreter refuses an all-NaN max.)"""
    vocab = 100  # chunks of 32: the last one is mostly masked lanes
    logits = random_logits(4, vocab)
    logits[0, ::2] = float("nan")
    logits[1, 1::3] = float("nan")
    logits[2, 97:] = float("nan")
    t, top_k, seeds, steps = rows(4, temperature=temperature, top_k=5)
    out = torch.empty(4, dtype=torch.int64)
    tokens = sample_triton(logits, t, top_k, None, seeds, steps, out, 8, chunk=32)
    assert bool(((tokens >= 0) & (tokens < vocab)).all()), tokens.tolist()
    assert tokens[3] == sample(logits[3:], t[3:], top_k[3:], seeds[3:], steps[3:], backend="torch")[0]


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = random_logits(16, 300)
    temperature, top_k, _, steps = rows(16, temperature=2.0, top_k=1)
    seeds = torch.arange(16)
    assert torch.equal(sample(logits, temperature, top_k, seeds, steps), logits.argmax(-1))
    tiny = torch.full((16,), 1e-6)
    assert torch.equal(sample(logits, temperature, top_k * 0, seeds, steps, top_p=tiny), logits.argmax(-1))


def test_tiny_temperature_stays_finite_and_greedy():
    """The smallest allowed temperature divides logit gaps, not logits: large logits must not
    overflow into +inf ties that the first index would win."""
    logits = torch.tensor([[5.0, 6.0, 5.5]])
    t = torch.tensor([1.1754944e-38])
    for step in range(5):
        assert sample(logits, t, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                      torch.tensor([step])).item() == 1


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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampling_is_independent_of_batch_position_and_neighbours(backend):
    target_logits = random_logits(1, 128, seed=5)[0]
    target = (1.3, 20, 0.8, 12345, 77)  # temperature, top_k, top_p, seed, step

    def run(logits, temperature, top_k, top_p, seeds, steps):
        return sample(logits, temperature, top_k, seeds, steps, max_top_k=32, top_p=top_p, backend=backend)

    one = [torch.tensor([v]) for v in target]
    alone = run(target_logits[None], one[0].float(), one[1].int(), one[2].float(), one[3], one[4])[0]
    for position, bs in ((0, 3), (4, 7), (6, 7)):
        logits = random_logits(bs, 128, seed=bs)
        logits[position] = target_logits
        temperature, top_k, top_p, seeds, steps = mixed_params(bs, 128, seed=bs)
        for column, value in zip((temperature, top_k, top_p, seeds, steps), target):
            column[position] = value
        assert run(logits, temperature, top_k, top_p, seeds, steps)[position] == alone


@settings(max_examples=60, deadline=None)
@given(
    bs=st.integers(1, 6),
    vocab=st.integers(1, 40),
    data_seed=st.integers(0, 2**16),
    quantize=st.booleans(),
    data=st.data(),
)
def test_sampled_tokens_are_always_in_the_kept_set(bs, vocab, data_seed, quantize, data):
    logits = random_logits(bs, vocab, seed=data_seed)
    if quantize:  # many ties: the threshold's ties count as kept
        logits = logits.round()
    temperature = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.1, 1.0, 10.0]), min_size=bs, max_size=bs)))
    top_k = torch.tensor(data.draw(st.lists(st.integers(0, vocab + 2), min_size=bs, max_size=bs)), dtype=torch.int32)
    top_p = torch.tensor(data.draw(st.lists(st.sampled_from([0.1, 0.5, 0.9, 1.0]), min_size=bs, max_size=bs)))
    seeds = torch.tensor(data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=bs, max_size=bs)))
    steps = torch.tensor(data.draw(st.lists(st.integers(0, 2**40), min_size=bs, max_size=bs)))
    max_top_k = data.draw(st.none() | st.integers(1, vocab + 2))

    tokens = sample(logits, temperature, top_k, seeds, steps, max_top_k=max_top_k, top_p=top_p)
    assert tokens.dtype == torch.int64 and tokens.shape == (bs,)
    threshold, _ = keep_threshold(logits, temperature, top_k, top_p, min(max_top_k or vocab, vocab))
    for row in range(bs):
        if temperature[row] == 0:
            assert tokens[row] == logits[row].argmax()
        else:
            assert logits[row, tokens[row]] >= threshold[row, 0]
            k = int(top_k[row]) if 0 < int(top_k[row]) < vocab else vocab
            k = min(k, max_top_k) if k < vocab and max_top_k is not None else k
            assert logits[row, tokens[row]] >= logits[row].sort(descending=True).values[k - 1]


CHI2_999 = {2: 13.82, 3: 16.27, 5: 20.52}  # chi-square 0.999 quantiles by degrees of freedom


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (2.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (1.5, 5, 0.8)],
)
def test_sample_frequencies_follow_tempered_softmax(temperature, top_k, top_p):
    """Over many seeds (and, separately, many steps) token frequencies match softmax(logits / T)
    renormalised over the kept set: a chi-square statistic below its 0.999 quantile. Noise that
    were biased or correlated across seeds or steps would fail this."""
    n = 6000
    logit_row = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    expected = torch.softmax(logit_row / temperature, dim=0).double()
    if top_k:
        expected[top_k:] = 0
    if top_p < 1:
        renormalised = expected / expected.sum()
        keep = (renormalised.cumsum(0) - renormalised) < top_p  # mass strictly before a token
        expected[~keep] = 0
    expected /= expected.sum()
    kept = int((expected > 0).sum())
    assert kept >= 3  # the parameters above leave a distribution worth testing
    temperature_t, top_k_t, _, _ = rows(n, temperature=temperature, top_k=top_k)
    top_p_t = torch.full((n,), top_p)
    for seeds, steps in ((torch.full((n,), 7), torch.arange(n)), (torch.arange(n), torch.full((n,), 7))):
        tokens = sample(logit_row.expand(n, 6).contiguous(), temperature_t, top_k_t, seeds, steps, top_p=top_p_t)
        counts = torch.bincount(tokens, minlength=6).double()
        assert (counts[expected == 0] == 0).all(), counts
        chi2 = float(((counts - n * expected)[expected > 0] ** 2 / (n * expected[expected > 0])).sum())
        assert chi2 < CHI2_999[kept - 1], (chi2, counts.tolist(), (n * expected).tolist())


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


def test_out_buffer_receives_tokens():
    logits, out = random_logits(3, 20), torch.full((3,), -1, dtype=torch.int64)
    assert sample(logits, *rows(3, temperature=0.0), out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, logits.argmax(-1))


def test_sample_rejects_bad_metadata():
    logits = random_logits(2, 10)
    temperature, top_k, seeds, steps = rows(2)
    cases = [
        (dict(logits=logits.double()), r"logits must be \[bs, vocab\] of \['torch.float32', 'torch.bfloat16'"),
        (dict(logits=logits[0]), r"logits must be \[bs, vocab\]"),
        (dict(temperature=temperature.double()), "temperature must be"),
        (dict(top_k=torch.zeros(3, dtype=torch.int32)), "top_k must be"),
        (dict(top_p=torch.ones(2, dtype=torch.float64)), "top_p must be"),
        (dict(top_p=torch.ones(3)), "top_p must be"),
        (dict(steps=steps.float()), "steps must be"),
        (dict(out=torch.empty(2, dtype=torch.int32)), "out must be an int64"),
        (dict(max_top_k=0), "max_top_k must be None or a positive int"),
        (dict(backend="cuda"), "backend 'cuda' is not one of"),
        (dict(backend="triton", logits=random_logits(2, 300), max_top_k=257), "ranks at most 256 logits"),
        (dict(backend="triton", logits=random_logits(2, 300)), "ranks at most 256 logits"),
        (dict(backend="triton", logits=random_logits(2, 20).t().contiguous().t()), "rows contiguous"),
    ]
    for change, match in cases:
        args = dict(logits=logits, temperature=temperature, top_k=top_k, seeds=seeds, steps=steps) | change
        with pytest.raises(ValueError, match=match):
            sample(**args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e-39}, r"temperature must be 0 \(greedy\) or a finite float >= 1.1754944e-38"),
        ({"temperature": 5e-324}, "temperature.*1.1754944e-38"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"top_p": 0.0}, r"top_p must be a float in \(0, 1\]"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": True}, "top_p"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=f"SamplingParams.{match}"):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges():
    assert SamplingParams(temperature=1.1754944e-38).temperature > 0
    assert SamplingParams(top_p=1).top_p == 1 and SamplingParams(top_p=1e-9).top_p == 1e-9


def test_pack_sampling_params_pads_with_greedy_rows():
    packed = pack_sampling_params([SamplingParams(0.7, 40, -3, 0.9), SamplingParams(1.0, 0, 2**62)], 4)
    assert packed.temperature.tolist() == pytest.approx([0.7, 1.0, 0.0, 0.0])
    assert packed.top_k.dtype == torch.int32 and packed.top_k.tolist() == [40, 0, 0, 0]
    assert packed.top_p.dtype == torch.float32 and packed.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0, 1.0])
    assert packed.seeds.dtype == torch.int64 and packed.seeds.tolist() == [-3, 2**62, 0, 0]
    with pytest.raises(ValueError, match="do not fit in a batch of 1"):
        pack_sampling_params([SamplingParams(), SamplingParams()], 1)


@triton.jit
def _kth_kernel(x_ptr, n, rank, out_ptr, BLOCK: tl.constexpr, LEVELS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr, _kth_largest(x, valid, rank, LEVELS))


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), n=st.integers(1, 256),
       data_seed=st.integers(0, 2**16), special=st.booleans())
def test_radix_select_searches_only_the_bytes_a_dtype_can_differ_in(dtype, n, data_seed, special):
    """The rank-th largest of 16-bit values widened to float32, searched over 2 (bfloat16) or 3
    (float16) key bytes instead of 4, equals torch's kth largest for every rank: negative values
    (whose keys' unsearched bytes are ones), signed zeros, subnormals, infinities and ties."""
    gen = torch.Generator().manual_seed(data_seed)
    x = torch.randn(n, generator=gen) * 4
    if special:
        picks = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 6e-8, -6e-8, 1.0, -1.0])
        x = torch.where(torch.rand(n, generator=gen) < 0.4, picks[torch.randint(0, len(picks), (n,), generator=gen)], x)
    # Widened here, exactly: the interpreter's own bfloat16 -> float32 conversion flushes subnormals.
    x = x.to(dtype).float()
    levels = select_levels(dtype)
    assert levels == {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4}[dtype]
    ordered = x.sort(descending=True).values
    out = torch.empty(1)
    for rank in sorted({1, n, 1 + n // 2, 1 + n // 3}):
        _kth_kernel[(1,)](x, n, rank, out, BLOCK=triton.next_power_of_2(max(n, 2)), LEVELS=levels)
        want = ordered[rank - 1]
        # Equal values (-0.0 and 0.0 compare equal, as the threshold test `logits >= kth` treats them).
        assert out[0] == want, f"rank {rank} of {x.tolist()}: selected {out[0].item()}, expected {want.item()}"


def test_the_first_pass_leaves_the_callers_counters_zero():
    """A caller's counters (the captured step passes its own) give the tokens a fresh zeroed
    buffer gives, call after call, and are zero again after every call: each cut row's last
    chunk program resets its count. If a count were left behind, the next call's last program
    would never see its row complete and would leave the row's threshold unset."""
    bs, vocab = 7, 600
    logits = 2 * random_logits(bs, vocab, seed=11)
    temperature, top_k, top_p, seeds, steps = mixed_params(bs, vocab, seed=12)
    counters = torch.zeros(bs, dtype=torch.int32)
    for step in range(3):
        fresh = sample_triton(logits, temperature, top_k, top_p, seeds, steps + step, torch.empty(bs, dtype=torch.int64),
                              32, chunk=64)
        kept = sample_triton(logits, temperature, top_k, top_p, seeds, steps + step, torch.empty(bs, dtype=torch.int64),
                             32, chunk=64, counters=counters)
        assert torch.equal(kept, fresh)
        assert not counters.any(), f"call {step} left counts {counters.tolist()}"
    for bad in (torch.zeros(bs, dtype=torch.int64), torch.zeros(bs + 1, dtype=torch.int32),
                torch.zeros(2 * bs, dtype=torch.int32)[::2]):
        with pytest.raises(ValueError, match="sampler counters must be a contiguous int32"):
            sample(logits, temperature, top_k, seeds, steps, max_top_k=32, top_p=top_p, backend="triton", counters=bad)
