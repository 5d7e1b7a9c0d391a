"""N-gram speculative decoding on the device (capture/iteration/ngram.py, capture/iteration/accept.py), on the CPU:
`propose`, `accept` and `TokenHistory.append` against plain-Python references on random
inputs, the verify-row layout, the capture linter over each op and the whole speculative
step, and an end-to-end check that propose + verify + accept + append emits exactly the tokens
plain one-token decoding emits, greedy and seeded-sampled.

`SpecStep` and `run_speculative` are shared with tests/gpu/test_speculative_gpu.py.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphrelay.capture.iteration.accept import Accepted, accept, verify_positions, verify_rows, verify_tokens
from graphrelay.capture.iteration.ngram import Drafts, TokenHistory, propose
from graphrelay.capture.iteration.sampling import sample
from graphrelay.lint import lint_step

MAX_REQS = 5

# ---- plain-Python references ------------------------------------------------------------------


def reference_propose(row: list[int], length: int, k: int, min_n: int, max_n: int) -> list[int]:
    """The drafts for one history row, by direct search (num_drafts = len of the result)."""
    tokens = row[:length]
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # latest first
            if tokens[start : start + n] == suffix:
                # Every draft needs a cache position below the row's limit: length + j < S.
                return tokens[start + n : start + n + k][: len(row) - length]
    return []


def reference_accept(drafts: list[int], num_drafts: int, target: list[int]) -> list[int]:
    emitted = []
    for j, token in enumerate(target):
        emitted.append(token)
        if j >= num_drafts or drafts[j] != token:
            break
    return emitted


# ---- propose ----------------------------------------------------------------------------------


@st.composite
def propose_cases(draw):
    size = draw(st.integers(2, 24))
    vocab = draw(st.integers(2, 6))
    min_n = draw(st.integers(1, 3))
    max_n = draw(st.integers(min_n, 4))
    k = draw(st.integers(1, 6))
    bs = draw(st.integers(1, 6))
    # Live slots are distinct; the rest of the bucket is padding on slot 0.
    live = draw(st.lists(st.integers(1, MAX_REQS), unique=True, max_size=bs))
    slots = live + [0] * (bs - len(live))
    slots = draw(st.permutations(slots))
    lengths = draw(st.lists(st.integers(0, size), min_size=bs, max_size=bs))
    # The whole table is random: tokens past a row's length are garbage propose must ignore.
    table = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=size, max_size=size),
                          min_size=MAX_REQS + 1, max_size=MAX_REQS + 1))
    dtype = draw(st.sampled_from((torch.int32, torch.int64)))
    return size, table, slots, lengths, k, min_n, max_n, dtype


def history_from(table: list[list[int]], dtype=torch.int32) -> TokenHistory:
    history = TokenHistory(len(table) - 1, len(table[0]), "cpu", dtype=dtype)
    history.tokens.copy_(torch.tensor(table))
    return history


def check_propose(case, use_out: bool, backend: str) -> None:
    _, table, slots, lengths, k, min_n, max_n, dtype = case
    history = history_from(table, dtype=dtype)
    out = Drafts(torch.full((len(slots), k), -7), torch.full((len(slots),), -7, dtype=torch.int32)) if use_out else None
    got = propose(history, torch.tensor(slots), torch.tensor(lengths), k, min_n, max_n, out=out, backend=backend)
    for i, (slot, length) in enumerate(zip(slots, lengths)):
        want = reference_propose(table[slot], length, k, min_n, max_n)
        context = f"row {i} slot {slot} length {length} history {table[slot][:length]} k={k} n={min_n}..{max_n}"
        assert got.num_drafts[i].item() == len(want), context
        assert got.tokens[i].tolist() == want + [0] * (k - len(want)), context
    if use_out:
        assert got.tokens is out.tokens and got.num_drafts is out.num_drafts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(propose_cases(), st.booleans())
def test_propose_matches_reference(case, use_out):
    check_propose(case, use_out, "torch")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(propose_cases(), st.booleans())
def test_propose_kernel_matches_reference(case, use_out):
    """The Triton kernel (interpreted on CPU) against the same reference."""
    check_propose(case, use_out, "triton")


def test_propose_prefers_longest_n_then_latest():
    """Hand-checked: the 2-gram (3, 4) occurs at 1..2 and the 1-gram 4 later at 5; max_n 2
    takes the 2-gram's continuation, min_n = max_n = 1 the latest 1-gram's."""
    row = [9, 3, 4, 7, 8, 4, 6, 3, 4, 7, 8, 0]
    history = history_from([[0] * 12, row])
    slots, lengths = torch.tensor([1]), torch.tensor([9])
    longest = propose(history, slots, lengths, 3, 1, 2)
    assert longest.tokens.tolist() == [[7, 8, 4]] and longest.num_drafts.tolist() == [3]
    single = propose(history, slots, lengths, 3, 1, 1)
    assert single.tokens.tolist() == [[6, 3, 4]] and single.num_drafts.tolist() == [3]
    # The continuation stops at the row's last token (index 8).
    stopped = propose(history, slots, lengths, 4, 1, 1)
    assert stopped.tokens.tolist() == [[6, 3, 4, 0]] and stopped.num_drafts.tolist() == [3]
    # At length 11 the 1-gram 8 continues with 4, 6, 3, 4, but only position 11 is left.
    capped = propose(history, slots, torch.tensor([11]), 4, 1, 1)
    assert capped.tokens.tolist() == [[4, 0, 0, 0]] and capped.num_drafts.tolist() == [1]


# ---- accept and the verify layout -------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_accept_matches_reference(data):
    bs, k = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 6))
    tokens = st.integers(0, 2)  # a tiny vocabulary: drafts often agree with the target
    drafts = data.draw(st.lists(st.lists(tokens, min_size=k, max_size=k), min_size=bs, max_size=bs))
    target = data.draw(st.lists(st.lists(tokens, min_size=k + 1, max_size=k + 1), min_size=bs, max_size=bs))
    num_drafts = data.draw(st.lists(st.integers(0, k), min_size=bs, max_size=bs))
    out = Accepted(torch.full((bs, k + 1), -1), torch.full((bs,), -1, dtype=torch.int32))
    got = accept(torch.tensor(drafts), torch.tensor(num_drafts), torch.tensor(target, dtype=torch.int32), out=out)
    assert got.tokens is out.tokens
    for i in range(bs):
        want = reference_accept(drafts[i], num_drafts[i], target[i])
        assert got.accept_len[i].item() == len(want), (drafts[i], num_drafts[i], target[i])
        assert got.tokens[i].tolist() == want + [0] * (k + 1 - len(want))


def test_verify_layout():
    slots, positions, k, size = torch.tensor([4, 0, 2]), torch.tensor([5, 0, 8]), 2, 10
    want = []
    for slot, position in zip(slots.tolist(), positions.tolist()):
        for j in range(k + 1):
            inside = position + j < size
            want.append((slot if inside else 0, min(position + j, size - 1)))
    rows = verify_rows(slots, positions, k, size)
    assert list(zip(rows.slots.tolist(), rows.positions.tolist())) == want
    assert verify_positions(positions, k, size).tolist() == [[5, 6, 7], [0, 1, 2], [8, 9, 9]]
    current, drafts = torch.tensor([7, 8, 9]), torch.tensor([[1, 2], [3, 4], [5, 6]])
    assert verify_tokens(current, drafts).tolist() == [7, 1, 2, 8, 3, 4, 9, 5, 6]


# ---- TokenHistory -----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_append_writes_exactly_the_counted_tokens(data):
    size, m = data.draw(st.integers(2, 16)), data.draw(st.integers(1, 5))
    bs = data.draw(st.integers(1, 6))
    live = data.draw(st.lists(st.integers(1, MAX_REQS), unique=True, max_size=bs))
    slots = data.draw(st.permutations(live + [0] * (bs - len(live))))
    # Positions reach outside the row so writes that would leave it are exercised; padding
    # rows carry arbitrary positions and counts.
    positions = data.draw(st.lists(st.integers(-2, size + 3), min_size=bs, max_size=bs))
    counts = data.draw(st.lists(st.integers(0, m), min_size=bs, max_size=bs))
    tokens = torch.randint(100, 200, (bs, m))
    history = TokenHistory(MAX_REQS, size, "cpu")
    history.tokens.copy_(torch.randint(0, 100, history.tokens.shape))
    want = history.tokens.clone()
    for i, slot in enumerate(slots):
        for j in range(counts[i]):
            if slot != 0 and 0 <= positions[i] + j < size:
                want[slot, positions[i] + j] = tokens[i, j]
    history.append(torch.tensor(slots), torch.tensor(positions, dtype=torch.int32), tokens, torch.tensor(counts))
    # Row 0 is scratch: anything may land there, nothing anywhere else.
    assert torch.equal(history.tokens[1:], want[1:]), (slots, positions, counts)


def test_write_tokens_writes_each_token_at_its_slot_and_position():
    history = TokenHistory(3, 8, "cpu")
    # A flat batch: a prompt chunk for slot 2 at 0..2, a later chunk at 3..4, a padding token.
    slots, positions = torch.tensor([2, 2, 2, 2, 2, 0]), torch.tensor([0, 1, 2, 3, 4, 5])
    history.write_tokens(slots, positions, torch.tensor([5, 6, 7, 8, 9, 4]))
    assert history.tokens[2].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert history.tokens[[1, 3]].count_nonzero().item() == 0  # row 0 is scratch
    with pytest.raises(ValueError, match="positions must be"):
        history.write_tokens(slots, positions[:3], torch.zeros(6, dtype=torch.int64))


# ---- a whole speculative step on a toy model --------------------------------------------------


class ToyModel:
    """Next-token logits looked up from (previous token, current token): a [V, V, V] table.
    Sharp logits make sequences settle into cycles, so prompt lookup finds real matches."""

    def __init__(self, vocab: int, seed: int, device):
        generator = torch.Generator().manual_seed(seed)
        self.table = (torch.randn(vocab, vocab, vocab, generator=generator) * 4).to(device)

    def logits(self, previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        return self.table[previous, current]  # [..., V]


class SpecBuffers(NamedTuple):
    """A step's static outputs for one bucket."""

    drafts: Drafts
    accepted: Accepted
    new_lengths: torch.Tensor  # [bs] int64

    @classmethod
    def alloc(cls, bs: int, k: int, device) -> "SpecBuffers":
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(Drafts(zeros(bs, k), zeros(bs)), Accepted(zeros(bs, k + 1), zeros(bs)), zeros(bs))


class SpecStep:
    """propose -> verify on the toy model (k + 1 query rows per request) -> sample -> accept
    -> append. Rows: slot and history length (the current token sits at length - 1)."""

    def __init__(self, history: TokenHistory, model: ToyModel, k: int, min_n: int, max_n: int):
        self.history, self.model, self.k, self.min_n, self.max_n = history, model, k, min_n, max_n

    def __call__(self, slots, lengths, temperature, top_k, seeds, out: SpecBuffers) -> None:
        bs, k, table = slots.shape[0], self.k, self.history.tokens
        drafts = propose(self.history, slots, lengths, k, self.min_n, self.max_n, out=out.drafts)
        last = (lengths - 1).clamp(min=0)  # [bs]: the current token's position
        current = table[slots, last]  # [bs]
        previous = table[slots, (last - 1).clamp(min=0)]  # [bs]
        rows = verify_tokens(current, drafts.tokens).view(bs, k + 1)  # [bs, k + 1]
        positions = verify_positions(last, k, self.history.max_seq_len)  # [bs, k + 1]
        context = torch.cat((previous.long()[:, None], rows), dim=1)  # [bs, k + 2]
        logits = self.model.logits(context[:, :-1], context[:, 1:]).view(bs * (k + 1), -1)
        # Each query row samples as plain decoding would at its position.
        params = [x[:, None].expand(bs, k + 1).reshape(-1) for x in (temperature, top_k, seeds)]
        target = sample(logits, *params, positions.view(-1))
        accepted = accept(drafts.tokens, drafts.num_drafts, target.view(bs, k + 1), out=out.accepted)
        self.history.append(slots, lengths, accepted.tokens, accepted.accept_len)
        torch.add(lengths, accepted.accept_len, out=out.new_lengths)


def plain_decode(model: ToyModel, prompt: list[int], total: int, temperature: float, top_k: int, seed: int) -> list[int]:
    """One token per step: the token at position t + 1 comes from the query at position t."""
    device = model.table.device
    tokens = list(prompt)
    while len(tokens) < total:
        logits = model.table[tokens[-2], tokens[-1]][None]  # [1, V]
        row = [torch.tensor([value], device=device) for value in (temperature, top_k, seed, len(tokens) - 1)]
        tokens.append(int(sample(logits, *row)))
    return tokens


class StaticBucket:
    """One bucket's static inputs (slots, lengths, temperature, top_k, seeds) and outputs, and
    `launch()`: the step run eagerly, or the CUDA graph replayed once `capture()` has run."""

    def __init__(self, step: SpecStep, bs: int, device):
        self.step, self.bs = step, bs
        dtypes = (torch.int64, torch.int64, torch.float32, torch.int64, torch.int64)
        self.inputs = [torch.zeros(bs, dtype=dtype, device=device) for dtype in dtypes]
        self.out = SpecBuffers.alloc(bs, step.k, device)
        self.graph = None

    def load(self, *values: list) -> None:
        for buffer, value in zip(self.inputs, values):
            buffer.copy_(torch.tensor(value, dtype=buffer.dtype))

    def capture(self, warmups: int = 3) -> None:
        """Warm up (all rows padding: only scratch row 0 is written) under sync-debug "error",
        then capture. Needs CUDA."""
        self.load([0] * self.bs, [0] * self.bs, [0.0] * self.bs, [0] * self.bs, [0] * self.bs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                for _ in range(warmups):
                    self.step(*self.inputs, self.out)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step(*self.inputs, self.out)

    def launch(self) -> None:
        if self.graph is None:
            self.step(*self.inputs, self.out)
        else:
            self.graph.replay()


def run_speculative(bucket: StaticBucket, prompts, params, total: int, rng: random.Random):
    """A host scheduler: each iteration batches the unfinished requests (random order, padded
    with slot 0 rows of random lengths), loads the bucket's inputs, launches, and reads back
    accept_len. Returns ({slot: tokens}, iterations)."""
    history, bs = bucket.step.history, bucket.bs
    for slot, prompt in enumerate(prompts, 1):
        on = dict(device=history.device)
        history.write_tokens(torch.full((len(prompt),), slot, **on), torch.arange(len(prompt), **on),
                             torch.tensor(prompt, **on))
    lengths = {slot: len(prompt) for slot, prompt in enumerate(prompts, 1)}
    iterations = 0
    while any(n < total for n in lengths.values()):
        batch = [slot for slot, n in lengths.items() if n < total]
        rng.shuffle(batch)
        batch = batch[:bs] + [0] * (bs - len(batch[:bs]))
        bucket.load(
            batch,
            [lengths[s] if s else rng.randint(0, history.max_seq_len) for s in batch],
            [params[s - 1][0] if s else 0.0 for s in batch],
            [params[s - 1][1] if s else 0 for s in batch],
            [params[s - 1][2] if s else 0 for s in batch],
        )
        bucket.launch()
        for slot, n in zip(batch, bucket.out.new_lengths.tolist()):
            if slot:
                lengths[slot] = min(n, total)  # the host truncates at the limit
        iterations += 1
    return {slot: history.tokens[slot, :total].tolist() for slot in lengths}, iterations


GREEDY_PARAMS = (0.0, 0, 0)
SAMPLED_PARAMS = ((0.7, 0, 3), (1.0, 3, -11))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("seed", range(4))
def test_speculative_decoding_emits_plain_decoding_tokens(sampled, seed):
    rng = random.Random(seed)
    vocab, size, k = 5, 40, 4
    model = ToyModel(vocab, seed, "cpu")
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 8))] for _ in range(MAX_REQS)]
    params = [rng.choice(SAMPLED_PARAMS) if sampled else GREEDY_PARAMS for _ in prompts]
    step = SpecStep(TokenHistory(MAX_REQS, size, "cpu"), model, k, min_n=1, max_n=3)
    got, iterations = run_speculative(StaticBucket(step, 4, "cpu"), prompts, params, size, rng)
    for slot, prompt in enumerate(prompts, 1):
        assert got[slot] == plain_decode(model, prompt, size, *params[slot - 1]), f"slot {slot}, params {params[slot - 1]}"
    generated = sum(size - len(p) for p in prompts)
    steps_plain = -(-generated // 4)  # iterations one-token decoding needs at 4 rows a bucket
    if not sampled:
        # Greedy toy sequences cycle: speculation must save whole iterations, or drafts never land.
        assert iterations < 0.75 * steps_plain, (iterations, steps_plain)


# ---- capturability ----------------------------------------------------------------------------

SLOTS = torch.tensor([3, 0, 5, 1])  # a padded bucket of 4
LENGTHS = torch.tensor([12, 1, 7, 20])


def lint_cases() -> dict:
    """name -> (step, example inputs, fewest torch ops the linter must record). The Triton
    kernel's launch is one call the linter looks through: it records no torch ops."""
    history, out = TokenHistory(MAX_REQS, 24, "cpu"), SpecBuffers.alloc(4, 3, "cpu")
    history.tokens.copy_(torch.randint(0, 3, history.tokens.shape, generator=torch.Generator().manual_seed(0)))
    step = SpecStep(history, ToyModel(3, 0, "cpu"), 3, 1, 3)
    sampling = (torch.tensor([0.0, 0.0, 0.7, 1.0]), torch.tensor([0, 0, 0, 2]), torch.tensor([0, 0, 5, -3]))
    accept_inputs = (torch.randint(0, 2, (4, 3)), torch.tensor([3, 0, 1, 2]), torch.randint(0, 2, (4, 4)))
    return {
        f"propose_{backend}": (
            lambda slots, lengths, backend=backend: propose(history, slots, lengths, 3, 1, 3, out=out.drafts, backend=backend),
            (SLOTS, LENGTHS), 20 if backend == "torch" else 0,
        )
        for backend in ("torch", "triton")
    } | {
        "accept": (lambda d, n, t: accept(d, n, t, out=out.accepted), accept_inputs, 5),
        "append": (history.append, (SLOTS, LENGTHS, torch.randint(0, 3, (4, 4)), torch.tensor([4, 1, 0, 2])), 5),
        "step": (lambda *args: step(*args, out), (SLOTS, LENGTHS, *sampling), 40),
    }


@pytest.mark.parametrize("name", ["propose_torch", "propose_triton", "accept", "append", "step"])
def test_capture_linter_finds_no_hazard(name):
    step, inputs, min_ops = lint_cases()[name]
    report = lint_step(step, inputs, target=name)
    assert report.ok, report.format()
    assert report.ops_recorded >= min_ops
