"""The fused Triton sampler on the GPU at the real vocabulary (SmolLM2's 49152): the same tokens
as the torch reference on the same device, bf16 logits as their float32 values, and a captured
CUDA graph of the sampler whose replays, after the logits and params are rewritten in place,
equal eager calls."""

from __future__ import annotations

import pytest
import torch

from graphrelay.capture.iteration.sampling import sample

pytestmark = pytest.mark.gpu

VOCAB = 49152
MAX_TOP_K = 64


def random_params(bs: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Mixed rows on the device: greedy, plain temperature, top-k, top-p, and both cuts."""
    kind = torch.randint(0, 5, (bs,), generator=gen)
    temperature = torch.where(kind == 0, 0.0, 0.3 + 1.5 * torch.rand(bs, generator=gen))
    top_k = torch.where((kind == 2) | (kind == 4), torch.randint(1, 100, (bs,), generator=gen), 0).int()
    top_p = torch.where(kind >= 3, 0.05 + 0.9 * torch.rand(bs, generator=gen), 1.0)
    seeds = torch.randint(-(2**62), 2**62, (bs,), generator=gen)
    steps = torch.randint(0, 2**20, (bs,), generator=gen).int()
    return {name: t.cuda() for name, t in
            dict(temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, steps=steps).items()}


def call(logits, p, backend, max_top_k, out=None):
    return sample(logits, p["temperature"], p["top_k"], p["seeds"], p["steps"], out=out, max_top_k=max_top_k,
                  top_p=p["top_p"], backend=backend)


@pytest.mark.parametrize("bs", [1, 64, 256])
@pytest.mark.parametrize("max_top_k", [MAX_TOP_K, 256])
def test_triton_matches_torch_at_full_vocab(bs, max_top_k):
    """Tokens equal on every row over several draws (greedy, temperature, top-k, top-p mixed).
    The logits are spread (std 4) so no two perturbed scores are within the ulp of log/exp by
    which the two backends may round apart; a mismatch here is a real divergence."""
    gen = torch.Generator().manual_seed(bs)
    mismatches, total = 0, 0
    for _ in range(4):
        logits = (4 * torch.randn(bs, VOCAB, generator=gen)).cuda()
        params = random_params(bs, gen)
        reference = call(logits, params, "torch", max_top_k)
        fused = call(logits, params, "triton", max_top_k)
        mismatches += int((reference != fused).sum())
        total += bs
        greedy = params["temperature"] == 0
        assert torch.equal(fused[greedy], logits.argmax(-1)[greedy])
    assert mismatches == 0, f"{mismatches} of {total} rows differ between the triton and torch samplers"


@pytest.mark.parametrize("bs", [1, 256])
def test_bf16_logits_sample_as_their_float32_values(bs):
    """The engine's plain step samples the LM head's bf16 output directly: the fused sampler
    gives the tokens of its exact float32 widening (bf16 makes near-ties and ties common)."""
    gen = torch.Generator().manual_seed(bs + 1)
    for _ in range(4):
        logits = (4 * torch.randn(bs, VOCAB, generator=gen)).to(torch.bfloat16).cuda()
        params = random_params(bs, gen)
        assert torch.equal(call(logits, params, "triton", MAX_TOP_K), call(logits.float(), params, "triton", MAX_TOP_K))


def test_captured_sampler_replays_equal_eager():
    """One graph of the fused sampler on static buffers, replayed after rewriting logits, seeds,
    steps and cuts in place, gives the eager tokens each time. If this failed, the kernel would
    read something captured by value (a shape, a pointer to a temporary) instead of the buffers."""
    bs = 64
    gen = torch.Generator().manual_seed(7)
    logits = torch.empty(bs, VOCAB, device="cuda")
    params = random_params(bs, gen)
    out = torch.full((bs,), -1, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up compiles the kernel before capture
        logits.normal_()
        call(logits, params, "triton", MAX_TOP_K, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(logits, params, "triton", MAX_TOP_K, out=out)
    for replay in range(20):
        logits.copy_(4 * torch.randn(bs, VOCAB, generator=gen))
        for name, value in random_params(bs, gen).items():
            params[name].copy_(value)
        out.fill_(-1)
        graph.replay()
        eager = call(logits, params, "triton", MAX_TOP_K)
        assert torch.equal(out, eager), f"replay {replay}: rows {(out != eager).nonzero().flatten().tolist()} differ"
        assert torch.equal(out, call(logits, params, "torch", MAX_TOP_K)), f"replay {replay}: differs from torch"


def test_rows_of_nan_logits_give_ids_inside_the_vocabulary():
    """A row of NaN logits (a padding row reading uninitialized memory) samples a meaningless
    but valid id, greedy or not: later kernels index the controls' tables and the logits by it.
    Rows without NaN beside it sample what they sample alone."""
    bs = 64
    gen = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(bs, VOCAB, generator=gen)).cuda()
    params = random_params(bs, gen)
    clean = call(logits, params, "triton", MAX_TOP_K).clone()
    logits[::2] = float("nan")
    logits[1::4, VOCAB - 5 :] = float("nan")
    tokens = call(logits, params, "triton", MAX_TOP_K)
    assert bool(((tokens >= 0) & (tokens < VOCAB)).all()), tokens.tolist()
    untouched = torch.arange(bs, device="cuda") % 4 == 3
    assert torch.equal(tokens[untouched], clean[untouched])
