"""Capturable steps: every op has a fixed shape in the bucket size, nothing reads values on
the host. The linter must report nothing for any of them (a finding here is a false positive).

Each factory returns (step, example_inputs); the step is run as step(*example_inputs).
"""

import torch

MAX_REQS, BUCKET, TOPK, HIDDEN, VOCAB, MAX_LEN = 8, 4, 3, 16, 32, 12


def _slots():
    # Two real requests padded to the bucket with slot 0 (the padding row).
    return torch.tensor([3, 5, 0, 0])


def relay_gather_scatter():
    """Gather rows by slot, then scatter new values back: the relay's shape of work."""
    tokens = torch.zeros(MAX_REQS + 1, dtype=torch.long)
    topk_probs = torch.zeros(MAX_REQS + 1, TOPK)
    seq_lens = torch.ones(MAX_REQS + 1, dtype=torch.int32)

    def step(slots, new_tokens, new_probs, out_tokens, out_probs):
        torch.index_select(tokens, 0, slots, out=out_tokens)  # [bs]
        out_probs.copy_(topk_probs[slots])  # [bs, topk]
        real = slots != 0  # padding rows must never change live rows
        tokens.index_put_((slots,), torch.where(real, new_tokens, tokens[0]))
        topk_probs.index_copy_(0, slots, torch.where(real[:, None], new_probs, topk_probs[0]))
        seq_lens.scatter_add_(0, slots, real.to(seq_lens.dtype))
        return out_tokens, out_probs

    inputs = (
        _slots(),
        torch.arange(BUCKET) + 7,
        torch.rand(BUCKET, TOPK),
        torch.empty(BUCKET, dtype=torch.long),
        torch.empty(BUCKET, TOPK),
    )
    return step, inputs


def decode_step():
    """One decode iteration of a toy attention model over a static KV cache."""
    torch.manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN)
    proj = torch.randn(HIDDEN, VOCAB)
    k_cache = torch.zeros(MAX_REQS + 1, MAX_LEN, HIDDEN)

    def step(input_ids, slots, positions, seq_lens):
        h = embed[input_ids]  # [bs, hidden]
        k_cache.index_put_((slots, positions), h)  # in-place KV write at each row's position
        keys = k_cache[slots]  # [bs, max_len, hidden]
        scores = torch.einsum("bh,blh->bl", h, keys) / HIDDEN**0.5
        visible = torch.arange(MAX_LEN)[None, :] < seq_lens[:, None]  # [bs, max_len]
        scores = scores.masked_fill(~visible, float("-inf"))
        context = torch.einsum("bl,blh->bh", torch.softmax(scores, dim=-1), keys)
        logits = (h + context) @ proj  # [bs, vocab]
        next_ids = logits.argmax(dim=-1)
        positions.add_(1)
        seq_lens.add_(1)
        return next_ids

    inputs = (
        torch.tensor([1, 4, 0, 0]),
        _slots(),
        torch.tensor([2, 5, 0, 0]),
        torch.tensor([3, 6, 1, 1]),
    )
    return step, inputs


def top_p_sampling():
    """Top-k / top-p sampling with fixed-shape masks and a static noise buffer."""

    def step(logits, noise, top_p, out_ids):
        probs, ids = torch.topk(torch.softmax(logits, dim=-1), TOPK, dim=-1)  # [bs, topk]
        cumulative = torch.cumsum(probs, dim=-1)
        keep = (cumulative - probs) < top_p[:, None]
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        choice = torch.argmax(probs / noise, dim=-1, keepdim=True)  # Gumbel-style pick
        torch.gather(ids, 1, choice, out=out_ids)
        ranks = torch.sort(logits, dim=-1, descending=True).indices[:, :1]
        return out_ids, ranks

    inputs = (
        torch.randn(BUCKET, VOCAB),
        torch.rand(BUCKET, TOPK) + 0.1,
        torch.full((BUCKET,), 0.9),
        torch.empty(BUCKET, 1, dtype=torch.long),
    )
    return step, inputs


def static_allocations_and_shapes():
    """Static allocations, Python ints from shapes, sized one_hot / repeat_interleave."""

    def step(x, ids):
        bs = x.shape[0]  # a Python int from a shape is fine
        scratch = torch.zeros(bs, HIDDEN)
        scratch += x
        one_hot = torch.nn.functional.one_hot(ids, VOCAB)  # [bs, vocab]
        repeated = torch.repeat_interleave(ids, torch.full((bs,), 2), output_size=2 * bs)
        offsets = torch.arange(bs) * HIDDEN
        moved = x.to(torch.float16).to(x.device)
        return scratch.sum(-1) + one_hot.sum(-1) + offsets, repeated, moved

    return step, (torch.randn(BUCKET, HIDDEN), torch.tensor([1, 2, 3, 4]))


def python_scalars_and_static_indices():
    """Python numbers become wrapped scalars or device fills, not copies; index tensors built
    once outside the step are state, like any other buffer."""
    columns = torch.tensor([1, 3])  # built once, at setup: on the GPU a device buffer

    def step(table, slots):
        scaled = table * 2.0 + 1
        scaled[slots] = 0.0  # a scalar write: a fill on the device
        picked = scaled[:, columns]  # [max_reqs + 1, 2]
        first = scaled[0, 1] + scaled[(1, 2)]  # Python int indices are views, no tensor built
        clipped = torch.where(picked > 0, picked, 0.0).clamp(max=3.0)
        return 1 - clipped[:, :1] * first

    return step, (torch.randn(MAX_REQS + 1, HIDDEN), _slots())


FACTORIES = [
    relay_gather_scatter,
    decode_step,
    top_p_sampling,
    static_allocations_and_shapes,
    python_scalars_and_static_indices,
]
