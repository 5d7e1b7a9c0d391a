"""`SamplingControls`: the per-slot device state of every control, the host calls that load it
at admission, and the capturable calls the step makes on its sampled rows.

Sampled rows are described the way the unified step describes them: per row its slot
(`row_slots`, 0 = padding) and its sampling step (`row_steps`, the position of the token it
samples from). A verify span is k + 1 consecutive rows of one slot.

Memory (dense token counts, int32): (max_reqs + 1) * V * 4 bytes, 100.7 MB at 512 slots x
49152 tokens, 8.2 MB at 64 x 32000. Reading a row of it costs what reading the row's logits
costs, with no search; a bounded sparse form (per-slot token list) would need a scatter into
a dense scratch or a search per token every step, to save memory that is small beside the KV
cache. Grammar tables: see `grammar.GrammarPool`.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import msgspec
import torch

from graphrelay.capture.iteration.sampling import LOGIT_DTYPES
from graphrelay.runtime import to_device_async

from .apply import PROMPT_BIT, ControlTables, apply_torch, apply_triton, span_row_drafts
from .grammar import GrammarCompiler, GrammarPool, span_states
from .logprobs import LogprobChannel
from .observe import observe_torch, observe_triton
from .params import ControlParams

BACKENDS = ("torch", "triton")


def _power_of_two(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value & (value - 1) == 0


class ControlsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Static widths. max_bias: logit_bias entries per request; max_stop: stop tokens a
    min_tokens request may mask (both powers of two: Triton vector widths); grammar_states:
    automaton rows in the shared pool (row 0 is reserved); logprobs: compute and carry them
    (a static choice: the graph holds the logprob work when on, and pays it per row whose
    request asked)."""

    max_bias: int = 32
    max_stop: int = 8
    grammar_states: int = 2048  # json_object alone takes ~1,100 states of SmolLM2's vocabulary
    logprobs: bool = True
    backend: Optional[str] = None  # "torch" | "triton"; default triton on CUDA

    def __post_init__(self) -> None:
        for name in ("max_bias", "max_stop"):
            if not _power_of_two(getattr(self, name)):
                raise ValueError(f"ControlsConfig.{name} must be a power of two >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.grammar_states, int) or self.grammar_states < 1:
            raise ValueError(f"ControlsConfig.grammar_states must be an int >= 1, got {self.grammar_states!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"ControlsConfig.backend must be None or one of {BACKENDS}, got {self.backend!r}")


class SamplingControls:
    """Device tables for `max_reqs` slots (row 0 = padding, neutral) over `vocab_size` tokens,
    and static outputs for up to `max_rows` sampled rows per step.

    Host (eager, async, never syncs): `admit`, `release`, `set_compiler`, and `in_use`: whether
    a slot's tables hold controls (the engine runs the controls variant of the step only then).
    Device (capturable, fixed shape in the row count n): `row_states`, `apply`, `observe`,
    `observe_prompt`, `span_states`, `write_logprobs`.
    """

    def __init__(self, config: ControlsConfig, max_reqs: int, vocab_size: int, max_rows: int,
                 device: torch.device | str, *, mirror_depth: int = 3, compiler: Optional[GrammarCompiler] = None):
        self.config, self.max_reqs, self.vocab_size, self.max_rows = config, max_reqs, vocab_size, max_rows
        self.device = torch.device(device)
        slots = max_reqs + 1
        self.grammar = GrammarPool(config.grammar_states, vocab_size, self.device)
        self.tables = ControlTables(
            counts=torch.zeros((slots, vocab_size), dtype=torch.int32, device=self.device),
            penalties=torch.tensor([[0.0, 0.0, 1.0]] * slots, dtype=torch.float32, device=self.device),
            eos_until=torch.zeros(slots, dtype=torch.int64, device=self.device),
            stop_ids=torch.full((slots, config.max_stop), -1, dtype=torch.int32, device=self.device),
            bias_ids=torch.full((slots, config.max_bias), -1, dtype=torch.int32, device=self.device),
            bias_values=torch.zeros((slots, config.max_bias), dtype=torch.float32, device=self.device),
            allowed=self.grammar.allowed,
        )
        # Automaton state per slot, plus a sink row (max_reqs + 1): the torch observe's target
        # for the rows that set no state (one index_copy_ target per row).
        self.slot_state = torch.zeros(slots + 1, dtype=torch.int32, device=self.device)
        self.states_out = torch.zeros(max_rows, dtype=torch.int32, device=self.device)
        self.logits_out = torch.zeros((max_rows, vocab_size), dtype=torch.float32, device=self.device)
        # Per slot, 1 where its request asked for logprobs: the channel skips the other rows.
        self.wants_logprobs = torch.zeros(slots, dtype=torch.int32, device=self.device)
        backend = config.backend or ("triton" if self.device.type == "cuda" else "torch")
        if backend == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("ControlsConfig.backend 'triton' on a CPU needs TRITON_INTERPRET=1 set before importing triton")
        self._apply = apply_triton if backend == "triton" else apply_torch
        self._observe = observe_triton if backend == "triton" else observe_torch
        self.logprobs = LogprobChannel(max_rows, mirror_depth, self.device, vocab_size, backend) if config.logprobs else None
        self.compiler = compiler
        self._grammar_of: dict[int, tuple[str, str]] = {}
        # Per slot, whether the params `admit` loaded change anything (host-side, so the engine
        # picks the step's variant without reading the device).
        self._active = [False] * slots

    @property
    def nbytes(self) -> int:
        """Device bytes of the tables and static outputs."""
        tensors = [*self.tables, self.grammar.next, self.slot_state, self.states_out, self.logits_out,
                   self.wants_logprobs]
        return sum(t.numel() * t.element_size() for t in tensors)

    def set_compiler(self, compiler: GrammarCompiler) -> None:
        """The grammar compiler over the model's vocabulary (needed for json_schema / regex)."""
        self.compiler = compiler

    # ---- host side ----------------------------------------------------------------------

    def check(self, params: Optional[ControlParams], stop_tokens: Sequence[int]):
        """Refuse params this engine cannot hold, naming the limit; compiles (and caches) the
        request's grammar, so a scheduler can check every request before serving any.
        Returns the compiled grammar (None when unconstrained)."""
        params = params or ControlParams()
        cfg = self.config
        if len(params.logit_bias) > cfg.max_bias:
            raise ValueError(f"logit_bias has {len(params.logit_bias)} entries; the static limit is "
                             f"ControlsConfig.max_bias = {cfg.max_bias}: send fewer or raise it")
        bad = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad} are outside the vocabulary (size {self.vocab_size})")
        if params.min_tokens and len(stop_tokens) > cfg.max_stop:
            raise ValueError(f"min_tokens masks the request's {len(stop_tokens)} stop tokens; the static limit is "
                             f"ControlsConfig.max_stop = {cfg.max_stop}: raise it")
        if params.logprobs is not None and self.logprobs is None:
            raise ValueError("logprobs were asked for but the engine was built with ControlsConfig.logprobs=False")
        if params.grammar is None:
            return None
        if self.compiler is None:
            raise ValueError("json_schema / regex need a grammar compiler over the model's vocabulary: "
                             "call SamplingControls.set_compiler (a text model) first")
        compiled = self.compiler.compile(*params.grammar)
        self.grammar.check_fits(compiled)
        return compiled

    def can_admit(self, params: Optional[ControlParams]) -> bool:
        """Whether the request's grammar fits the pool now (after `check` passed)."""
        if params is None or params.grammar is None:
            return True
        return self.grammar.can_hold(params.grammar, self.compiler.compile(*params.grammar))

    def admit(self, slot: int, params: Optional[ControlParams], stop_tokens: Sequence[int], prompt: Sequence[int]) -> None:
        """Reset `slot` for a new request: its params, its token counts (the prompt's tokens
        marked seen) and its automaton state. Queued on the current stream; before the
        request's first sampled row. Bad params raise before anything changes."""
        params = params or ControlParams()
        if not 1 <= slot <= self.max_reqs:
            raise ValueError(f"slot {slot} is outside 1..max_reqs {self.max_reqs}")
        compiled = self.check(params, stop_tokens)
        cfg = self.config
        grammar = params.grammar
        state = 0 if compiled is None else self.grammar.acquire(grammar, compiled)
        self.release(slot)
        if grammar is not None:
            self._grammar_of[slot] = grammar
        t = self.tables
        stops = list(stop_tokens)[: cfg.max_stop] if params.min_tokens else []
        ids, values = list(params.logit_bias), list(params.logit_bias.values())
        # The token sampled at step len(prompt) - 1 is the first generated: the stop tokens stay
        # masked while fewer than min_tokens were generated, i.e. below this step.
        first_step = len(prompt) - 1
        self._put(t.penalties[slot], [params.frequency_penalty, params.presence_penalty, params.repetition_penalty])
        self._put(t.bias_values[slot], values + [0.0] * (cfg.max_bias - len(values)))
        self._put(t.bias_ids[slot], ids + [-1] * (cfg.max_bias - len(ids)))
        self._put(t.stop_ids[slot], stops + [-1] * (cfg.max_stop - len(stops)))
        self._put(t.eos_until[slot : slot + 1], [first_step + params.min_tokens])
        self._put(self.slot_state[slot : slot + 1], [state])
        self._put(self.wants_logprobs[slot : slot + 1], [int(params.logprobs is not None)])
        # Any field off its default acts; the reset above is what lets a slot skip the controls
        # while inactive (its counts and state go stale) and start clean when next admitted.
        self._active[slot] = params != ControlParams()
        t.counts[slot].zero_()
        if prompt:
            t.counts[slot].index_fill_(0, to_device_async(torch.tensor(list(prompt)), self.device), PROMPT_BIT)

    def in_use(self, slots: Sequence[int]) -> bool:
        """Whether any of `slots` was admitted with params that change something (penalties,
        bias, min_tokens, grammar or logprobs): only then must an iteration run the controls."""
        return any(self._active[slot] for slot in slots)

    def release(self, slot: int) -> None:
        """The request on `slot` finished: its grammar's rows may be reused once idle."""
        key = self._grammar_of.pop(slot, None)
        if key is not None:
            self.grammar.release(key)

    def _put(self, dst: torch.Tensor, values: list) -> None:
        dst.copy_(to_device_async(torch.tensor(values, dtype=dst.dtype), self.device), non_blocking=True)

    # ---- device side (capturable) ---------------------------------------------------------

    def row_states(self, row_slots: torch.Tensor) -> torch.Tensor:
        """Each row's automaton state, its slot's current one: [n] int32 (static buffer)."""
        n = row_slots.shape[0]
        return torch.index_select(self.slot_state, 0, row_slots, out=self.states_out[:n])

    def span_rows(self, slots: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For verify spans, request-major (request i's k + 1 rows are i * (k + 1) + j):
        (row_states [b * (k + 1)] int32: the automaton state after drafts 0..j-1; row_drafts
        [b * (k + 1), k]: those drafts, -1 padded), from slots [b] and drafts [b, k]."""
        states = span_states(self.grammar.next, self.slot_state[slots.long()], drafts)
        return states.reshape(-1), span_row_drafts(drafts)

    def apply(self, logits: torch.Tensor, row_slots: torch.Tensor, row_steps: torch.Tensor,
              row_states: torch.Tensor, row_drafts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Controlled logits [n, V] float32 in a static buffer; `logits` (float32, or the
        model's 16-bit LM head output, read as its float32 values) stays raw. Only metadata is
        checked (capturable)."""
        n = logits.shape[0]
        if (logits.dtype not in LOGIT_DTYPES or logits.shape[1] != self.vocab_size or logits.stride(1) != 1
                or n > self.max_rows):
            raise ValueError(f"SamplingControls.apply takes logits [n <= {self.max_rows}, {self.vocab_size}] of "
                             f"{[str(d) for d in LOGIT_DTYPES]} with contiguous rows, got {logits.dtype} "
                             f"{tuple(logits.shape)} strides {logits.stride()}")
        return self._apply(self.tables, logits, row_slots, row_steps, row_states, self.logits_out[:n], row_drafts)

    def observe(self, row_slots: torch.Tensor, tokens: torch.Tensor, row_states: torch.Tensor,
                emitted: Optional[torch.Tensor] = None) -> None:
        """Count each emitted row's token and advance its slot's automaton. emitted [n] bool
        (default: every row of a real slot); within a slot, emitted rows must be consecutive
        and the last of them sets the state (a verify span's accepted prefix)."""
        if emitted is None:
            emitted = row_slots != 0
        self._observe(self.tables.counts, self.grammar.next, self.slot_state, row_slots, tokens, row_states, emitted)

    def observe_prompt(self, token_slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Mark prompt tokens seen (repetition penalty), for a step that stages prompts itself:
        token_slots [T] (0 = padding), tokens [T]. `admit` does this from the whole prompt."""
        self.tables.counts.view(-1).scatter_(0, token_slots.long() * self.vocab_size + tokens.long(), PROMPT_BIT)

    def before_sample(self, logits: torch.Tensor, row_slots: torch.Tensor, row_steps: torch.Tensor,
                      row_states: Optional[torch.Tensor] = None,
                      row_drafts: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(controlled logits to sample from, the rows' automaton states): `row_states` by
        default is each slot's current state (one row per request; for verify spans pass
        both of `span_rows`)."""
        states = self.row_states(row_slots) if row_states is None else row_states
        return self.apply(logits, row_slots, row_steps, states, row_drafts), states

    def after_sample(self, row_slots: torch.Tensor, raw_logits: torch.Tensor, tokens: torch.Tensor,
                     row_states: torch.Tensor, iteration: torch.Tensor, emitted: Optional[torch.Tensor] = None) -> None:
        """Count and advance by the emitted tokens, and carry the logprobs of the rows whose
        request asked to the host (rows not emitted as padding, as the mirror writes them) for
        mirror iteration `iteration` ([1] int64 on the device)."""
        self.observe(row_slots, tokens, row_states, emitted)
        self.write_logprobs(row_slots if emitted is None else torch.where(emitted, row_slots, 0), raw_logits, tokens,
                            iteration)

    def write_logprobs(self, row_slots: torch.Tensor, raw_logits: torch.Tensor, tokens: torch.Tensor,
                       iteration: torch.Tensor) -> None:
        """Logprobs of this step's rows into the channel, for mirror iteration `iteration`:
        computed for the rows whose slot was admitted asking for them (the others read None)."""
        if self.logprobs is not None:
            self.logprobs.write(row_slots, raw_logits, tokens, iteration, self.wants_logprobs)
