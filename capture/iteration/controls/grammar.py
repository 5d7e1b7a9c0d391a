"""Grammar-constrained decoding: a JSON schema or a regex compiled on the host by outlines-core
into a token-level automaton, loaded into static device tables shared by all slots.

Device tables (one pool, `states` rows, row 0 = "unconstrained"):
  allowed [states, ceil(V / 32)] int32: bit t % 32 of word t // 32 = token t allowed;
  next    [states, V] int32: the state reached by emitting token t (global row ids).
A slot's current state is a row id; 0 allows every token and stays 0, so an unconstrained
request costs the same lookups as a constrained one and nothing branches on values.

Why a dense next-state table: one load per sampled row, fixed shape, no search; its cost is
`states * V * 4` bytes (49152 tokens: 192 KiB per state, 384 MiB for 2048 states). A CSR form
would be smaller for narrow states but needs a bounded search per lookup, and the states of a
JSON string accept nearly the whole vocabulary, so it saves little on real schemas.

EOS: outlines-core allows the EOS token only in accepting states (it loops there), so EOS is
masked until the output matches.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch

from graphrelay.capture.iteration.controls.json_bounds import enforce_numeric_bounds
from graphrelay.runtime import to_device_async


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class CompiledGrammar:
    """One automaton with dense local state ids 0..n-1 (0 = initial): `allowed` [n, V] bool and
    `next` [n, V] int32 (a disallowed token stays in its state: it is never sampled)."""

    def __init__(self, allowed: np.ndarray, next_state: np.ndarray):
        self.allowed, self.next = allowed, next_state

    @property
    def states(self) -> int:
        return self.allowed.shape[0]

    def packed_allowed(self) -> np.ndarray:
        """[n, words] int32 bitmask (bit t % 32 of word t // 32)."""
        n, vocab = self.allowed.shape
        padded = np.zeros((n, bitmask_words(vocab) * 32), dtype=np.uint64)
        padded[:, :vocab] = self.allowed
        words = (padded.reshape(n, -1, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
        return words.astype(np.uint32).view(np.int32)


def vocabulary(token_strings: Sequence[Optional[str]], eos_token: int):
    """An outlines-core Vocabulary from each token id's text (None: a special token that no
    grammar may emit)."""
    from outlines_core import Vocabulary

    by_text: dict[str, list[int]] = {}
    for token, text in enumerate(token_strings):
        if text is not None and token != eos_token and text:
            by_text.setdefault(text, []).append(token)
    return Vocabulary(eos_token, by_text)


def tokenizer_strings(tokenizer) -> list[Optional[str]]:
    """Each token id's text from a transformers tokenizer (special tokens None).
    NOTE: a byte-level token holding part of a UTF-8 character comes out as U+FFFD, so a
    grammar sees it as that character; outputs stay valid, such tokens are just rarely fit."""
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [None if i in special else tokenizer.convert_tokens_to_string([p]) for i, p in enumerate(pieces)]


def made_up_token_strings(vocab_size: int, seed: int = 0) -> list[Optional[str]]:
    """A text vocabulary for a model without a tokenizer (random weights: tests, benchmarks):
    token 0 special (use it as EOS), then printable ASCII, then distinct seeded pairs of it."""
    rng = random.Random(seed)
    chars = [chr(c) for c in range(32, 127)]
    strings: list[Optional[str]] = [None] + chars[: vocab_size - 1]
    seen = set(strings)
    while len(strings) < vocab_size:
        text = rng.choice(chars) + rng.choice(chars) + ("" if len(seen) < 95 * 95 else rng.choice(chars))
        if text not in seen:
            seen.add(text)
            strings.append(text)
    return strings


class GrammarCompiler:
    """Compiles (kind, source) to a `CompiledGrammar` over `vocab_size` tokens, keeping the
    `cache_size` most recently used (a grammar's host tables are states x vocab x 5 bytes:
    a long-lived server that sees many schemas must not keep them all)."""

    def __init__(self, outlines_vocabulary, vocab_size: int, cache_size: int = 16):
        if not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"GrammarCompiler cache_size must be a positive int, got {cache_size!r}")
        self.vocabulary, self.vocab_size, self.cache_size = outlines_vocabulary, vocab_size, cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    def compile(self, kind: str, source: str) -> CompiledGrammar:
        key = (kind, source)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        grammar = self._cache[key] = self._build(kind, source)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return grammar

    def _build(self, kind: str, source: str) -> CompiledGrammar:
        from outlines_core import Index

        if kind == "json_schema":
            regex = enforce_numeric_bounds(source)  # outlines-core alone drops minimum / maximum
        elif kind == "regex":
            regex = source
        else:
            raise ValueError(f"grammar kind must be 'json_schema' or 'regex', got {kind!r}")
        try:
            index = Index(regex, self.vocabulary)
        except Exception as e:
            raise ValueError(f"{kind} cannot be compiled into a token automaton: {e}") from None
        transitions = index.get_transitions()
        initial = index.get_initial_state()
        order = [initial] + sorted(s for s in transitions if s != initial)
        local = {s: i for i, s in enumerate(order)}
        n = len(order)
        allowed = np.zeros((n, self.vocab_size), dtype=bool)
        next_state = np.repeat(np.arange(n, dtype=np.int32)[:, None], self.vocab_size, axis=1)
        for state, edges in transitions.items():
            row = local[state]
            tokens = np.fromiter(edges.keys(), dtype=np.int64, count=len(edges))
            allowed[row, tokens] = True
            next_state[row, tokens] = [local[t] for t in edges.values()]
        return CompiledGrammar(allowed, next_state)


class GrammarPool:
    """The device tables, `states` rows (row 0 unconstrained), and a host first-fit allocator of
    contiguous row ranges, one per distinct grammar in use, shared by the slots using it."""

    def __init__(self, states: int, vocab_size: int, device: torch.device):
        if states < 1:
            raise ValueError(f"grammar_states must be >= 1 (row 0 is the unconstrained state), got {states}")
        self.states, self.vocab_size, self.device = states, vocab_size, device
        self.allowed = torch.zeros((states, bitmask_words(vocab_size)), dtype=torch.int32, device=device)
        self.allowed[0] = -1  # every bit set
        self.next = torch.zeros((states, vocab_size), dtype=torch.int32, device=device)
        self._ranges: dict[tuple[str, str], list[int]] = {}  # key -> [base, size, users]

    def acquire(self, key: tuple[str, str], grammar: CompiledGrammar) -> int:
        """The global row of `grammar`'s initial state, loading it (async) if not resident."""
        if key in self._ranges:
            self._ranges[key][2] += 1
            return self._ranges[key][0]
        self.check_fits(grammar)
        base = self._place(grammar.states)
        self._ranges[key] = [base, grammar.states, 1]
        rows = slice(base, base + grammar.states)
        self.allowed[rows].copy_(to_device_async(torch.from_numpy(grammar.packed_allowed()), self.device), non_blocking=True)
        self.next[rows].copy_(to_device_async(torch.from_numpy(grammar.next + base), self.device), non_blocking=True)
        return base

    def check_fits(self, grammar: CompiledGrammar) -> None:
        if grammar.states > self.states - 1:
            raise ValueError(
                f"this grammar needs {grammar.states} automaton states but the static budget is "
                f"{self.states - 1} (ControlsConfig.grammar_states - 1): raise grammar_states or simplify the schema"
            )

    def release(self, key: tuple[str, str]) -> None:
        """One user fewer; the rows stay loaded (a later request reuses them) until space is needed."""
        self._ranges[key][2] -= 1

    def can_hold(self, key: tuple[str, str], grammar: CompiledGrammar) -> bool:
        """Whether `acquire` would succeed now, evicting idle grammars as needed (a scheduler
        holds a request back until it does)."""
        in_use = [(b, b + n) for b, n, users in self._ranges.values() if users]
        return key in self._ranges or self._first_gap(grammar.states, in_use) is not None

    def _first_gap(self, size: int, used: list[tuple[int, int]]) -> Optional[int]:
        start = 1
        for lo, hi in sorted(used):
            if lo - start >= size:
                return start
            start = hi
        return start if self.states - start >= size else None

    def _place(self, size: int) -> int:
        """First fit among the gaps; evicts unused grammars (fewest rows first) when none fits.
        Overwriting an evicted range is safe: the load is queued on the engine's one stream,
        after every iteration already launched that could still read the old rows."""
        while True:
            base = self._first_gap(size, [(b, b + n) for b, n, _ in self._ranges.values()])
            if base is not None:
                return base
            idle = [k for k, (_, _, users) in self._ranges.items() if users == 0]
            if not idle:
                raise RuntimeError(
                    f"the grammar pool ({self.states} states, ControlsConfig.grammar_states) is full with grammars in "
                    f"use; a grammar of {size} states must wait for one to finish, or raise grammar_states"
                )
            del self._ranges[min(idle, key=lambda k: self._ranges[k][1])]


def span_states(next_table: torch.Tensor, first: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """States for a verify span's k + 1 rows: row 0 at `first` [b], row j + 1 after drafts
    [b, k] 0..j. Fixed shape, capturable: returns [b, k + 1] int32 (k gathers)."""
    states = [first.to(torch.int32)]
    for j in range(drafts.shape[1]):
        states.append(next_table[states[-1].long(), drafts[:, j].long()])
    return torch.stack(states, dim=1)
