"""The unified iteration, captured whole, one graph per token bucket:

    prologue: relay resolve (decode spans' input token and position), positions and slots of
        every token, decode ids into the flat batch, the embedding rows (one launch on CUDA:
        `capture.kernels.iteration_prologue`)
        -> [speculation: token history, n-gram drafts into the verify spans, then the embedding]
        -> model layers over all T tokens (prefill chunks, decode rows, verify spans)
        -> LM head only at the sampled rows (in the model's dtype, read as float32 from here on)
        -> [controls: penalties, bias, min_tokens, grammar]
        -> sampling -> [speculation: accept the leading drafts the target agrees with]
        -> [controls: counts, automaton states, logprobs of the emitted rows that asked]
        -> relay stash + publish -> host-mirror write (one launch on CUDA without speculation:
        `capture.kernels.iteration_epilogue`, which in the plain variant also runs the sampler's
        last pass, so the relay costs no launch of its own; two, plus their glue, otherwise)

A step built with controls runs in two variants, each captured per bucket: "controls" (the
bracketed controls ops) and "plain" (without them: what an engine without controls runs), so
a batch in which no request uses a control pays nothing for them. The host picks the variant
per iteration (`Engine.launch`).

One route for every token: a prompt's first sampled token goes through the relay and the
mirror exactly like a decode token. Every buffer is allocated here or by the parts before
capture; `step(T)` reads and writes the bucket's views of them, syncs nothing and branches on
no value.

Sampled rows and the mirror are request-major: span r owns rows r * (k + 1) + j. A verify
span's row j samples after its j-th token; a decode or last-prompt-chunk span reports one
row; rows that are not emitted (rejected drafts, prompt chunks that do not end their
prompt, padding) carry slot 0, which the host reader drops. Each emitted row carries its own
seq len, so the host appends a variable number of tokens per request with one loop.
"""

from __future__ import annotations

from typing import Optional

import torch

from graphrelay.capture.iteration.accept import Accepted, accept
from graphrelay.capture.iteration.inputs import IterationInputs
from graphrelay.capture.iteration.ngram import Drafts, SpecConfig, TokenHistory, propose
from graphrelay.capture.iteration.controls.state import SamplingControls
from graphrelay.capture.iteration.sampling import sample, sample_chunks, triton_applies
from graphrelay.capture.kernels.iteration_epilogue import check_fusable, stash_publish_mirror
from graphrelay.capture.kernels.iteration_prologue import IterationPrologue
from graphrelay.capture.model.model import LlamaModel
from graphrelay import Relay, RelayPayload
from graphrelay.mirror import HostMirror

PLAIN, CONTROLS = "plain", "controls"  # the step's variants (see the module docstring)


def span_values_per_row(t: torch.Tensor, spans: int, per: int) -> torch.Tensor:
    """[spans] -> [spans * per], request-major, always a contiguous copy: at one span, reshape
    alone would return a stride-0 view, and the Triton kernels read rows as `ptr + row`."""
    return t[:spans, None].expand(spans, per).contiguous().view(-1)


class IterationStep:
    """Binds a relay, a model, a host mirror, the input surface and (when speculating) the
    token history into `step(T)`.

    The relay and the mirror must be built with `validate=False`: their host-side checks read
    values (a sync) and the step runs under sync-debug "error" during warm-up. Slots are
    validated where the scheduler assigns them.

    backend: "triton" fuses the prologue, and without speculation the epilogue, into one
    kernel each; "torch" runs the glue (the reference). None: Triton on
    CUDA unless the relay is in debug mode.
    """

    def __init__(self, relay: Relay, model: LlamaModel, mirror: HostMirror, inputs: IterationInputs, *,
                 spec: Optional[SpecConfig] = None, history: Optional[TokenHistory] = None,
                 max_top_k: Optional[int] = None, controls: Optional[SamplingControls] = None,
                 backend: Optional[str] = None):
        cfg = relay.config
        per = spec.rows if spec else 1
        top = inputs.geometry(inputs.max_tokens)
        if inputs.rows_per_span != per:
            raise ValueError(f"inputs.rows_per_span {inputs.rows_per_span} must be {per} (k + 1 when speculating)")
        if cfg.max_batch < top.rows:
            raise ValueError(f"RelayConfig.max_batch {cfg.max_batch} must hold the {top.rows} sampled rows "
                             f"(one mirror row per sampled row)")
        if model.max_reqs != cfg.max_reqs:
            raise ValueError(f"model.max_reqs {model.max_reqs} must equal RelayConfig.max_reqs {cfg.max_reqs}")
        if spec is not None and (history is None or cfg.accepted_tokens is None or cfg.accept_len is None):
            raise ValueError("a speculative step needs a TokenHistory and a relay with accepted_tokens and accept_len")
        self.relay, self.model, self.mirror, self.inputs = relay, model, mirror, inputs
        self.spec, self.history, self.max_top_k, self.per = spec, history, max_top_k, per
        self.controls = controls
        device, spans, rows = relay.device, top.spans + 1, top.rows
        self.scratch = inputs.max_tokens  # the token buffer's scratch entry
        # Eager runs only: a host-known bound on every position + 1 this iteration (the engine
        # sets it before an eager step; None under capture, which runs at full shape).
        self.key_bound: Optional[int] = None
        # Speculation writes the drafts into the ids after the prologue: the model embeds them.
        self.prologue = IterationPrologue(relay, model.embed, model.config.max_seq_len, top, embeds=spec is None,
                                          backend=backend)
        # Without speculation every row emits at most its one token, so the controls' bookkeeping
        # can run before the epilogue instead of inside it: both variants fuse it.
        self.fused_epilogue = self.prologue.backend == "triton" and spec is None
        if self.fused_epilogue:
            check_fusable(relay, mirror)
        # The LM head's output as the GEMM writes it, in the model's dtype: the sampler, the
        # controls and the logprobs read it as float32 values (widening is exact), so no float32
        # copy of [rows, vocab] is made (the controls write theirs, edited, into their own buffer).
        self.logits = torch.zeros((rows, model.config.vocab_size), dtype=model.config.torch_dtype, device=device)
        # The plain variant's epilogue picks the tokens itself from the sampler's chunk results
        # (one launch fewer), where the Triton sampler can rank max_top_k.
        self.pick_in_epilogue = self.fused_epilogue and triton_applies(self.logits, max_top_k)
        self.target = torch.zeros(rows, dtype=torch.int64, device=device)
        # The Triton sampler's per-row counters (zero between calls), allocated here so that no
        # captured graph zeroes its own.
        self.sample_counters = torch.zeros(rows, dtype=torch.int32, device=device)
        self.columns = torch.arange(per, device=device)  # [k + 1]
        if spec is not None:
            self.drafts = Drafts(torch.zeros((spans, spec.k), dtype=torch.int64, device=device),
                                 torch.zeros(spans, dtype=torch.int64, device=device))
            self.accepted = Accepted(torch.zeros((spans, per), dtype=torch.int64, device=device),
                                     torch.zeros(spans, dtype=torch.int64, device=device))

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants this step runs, the fullest last."""
        return (PLAIN,) if self.controls is None else (PLAIN, CONTROLS)

    def __call__(self, tokens: int, variant: Optional[str] = None) -> None:
        """One iteration of `tokens` (a bucket) in `variant` (default: the fullest)."""
        if variant is None:
            variant = self.variants[-1]
        elif variant not in self.variants:
            raise ValueError(f"variant {variant!r} is not one of this step's {self.variants}")
        controls = self.controls if variant == CONTROLS else None
        fused = self.fused_epilogue
        g = self.inputs.geometry(tokens)
        R, per = g.spans, self.per
        v = self.inputs.narrow(tokens)
        live_slots = v.span_slot[:R]
        placed = self.prologue(v, g)
        slots, positions, base, row_positions = placed.slots, placed.positions, placed.base, placed.row_positions
        drafts = None
        if self.spec is not None:
            drafts = self._draft(v, R, slots, positions, base)
        hidden = self.model.forward(v.ids[:tokens], slots, positions, v.q_block_start, v.q_block_len, g.q_block,
                                    key_bound=self.key_bound, embedded=placed.embedded, rows=v.row_token)
        logits = self.model.logits(hidden, out=self.logits[: g.rows])

        def per_row(t: torch.Tensor) -> torch.Tensor:
            return span_values_per_row(t, R, per)

        first = row_positions.view(R, per)[:, 0]  # position of the token row 0 samples after
        # The fused epilogue finds each row's reported slot itself (the controls need it anyway).
        reported = None if fused and controls is None else torch.where(v.span_samples[:R].bool(), live_slots, 0)
        raw_logits = logits
        if controls is not None:
            # Penalties, bias, min_tokens and the grammar mask; a verify row j is controlled as
            # if drafts 0..j-1 were emitted (their counts, the automaton state after them).
            row_slots = per_row(reported)
            spans = () if self.spec is None else controls.span_rows(reported, drafts.tokens)
            logits, row_states = controls.before_sample(logits, row_slots, row_positions, *spans)
        # The draw at a row uses its token's position as the step: what plain decoding uses at
        # that position, in every mode and batch composition.
        if self.pick_in_epilogue and controls is None:
            picks = sample_chunks(logits, per_row(v.temperature), per_row(v.top_k), per_row(v.seeds), row_positions,
                                  max_top_k=self.max_top_k, top_p=per_row(v.top_p),
                                  counters=self.sample_counters[: g.rows])
            stash_publish_mirror(self.relay, self.mirror, v.span_slot, v.span_samples, v.row_live,
                                 self.target[: g.rows], row_positions, picks=picks)
            return
        target = sample(logits, per_row(v.temperature), per_row(v.top_k), per_row(v.seeds), row_positions,
                        out=self.target[: g.rows], max_top_k=self.max_top_k, top_p=per_row(v.top_p),
                        counters=self.sample_counters[: g.rows])
        if fused:
            if controls is not None:  # before the mirror write, which advances its counter (below)
                controls.after_sample(row_slots, raw_logits, target, row_states, self.mirror.device_ring[1],
                                      v.row_live != 0)
            stash_publish_mirror(self.relay, self.mirror, v.span_slot, v.span_samples, v.row_live, target,
                                 row_positions)
            return
        if self.spec is None:
            accept_len = None
            tokens_out, next_token, counts = target, target, 1
        else:
            accepted = accept(drafts.tokens, drafts.num_drafts, target.view(R, per),
                              out=Accepted(self.accepted.tokens[:R], self.accepted.accept_len[:R]))
            counts = accepted.accept_len
            self.history.append(reported, first + 1, accepted.tokens, counts)
            tokens_out = accepted.tokens.view(-1)
            next_token = accepted.tokens.gather(1, (counts - 1)[:, None])[:, 0]
            accept_len = per_row(counts)
        new_seq_lens = first + counts
        payload = (RelayPayload(tokens=next_token) if self.spec is None else
                   RelayPayload(tokens=next_token, accepted_tokens=accepted.tokens, accept_len=counts))
        self.relay.stash_and_publish(reported, payload, new_seq_lens)
        limit = counts if self.spec is None else counts[:, None]
        emitted = (v.row_live.view(R, per) != 0) & (self.columns[None, :] < limit)
        if controls is not None:  # counts, states, and logprobs of the emitted rows that asked
            # Before the mirror write: the logprobs go to the ring slot of the iteration the
            # mirror's counter holds, which that write then advances.
            controls.after_sample(row_slots, raw_logits, target, row_states, self.mirror.device_ring[1],
                                  emitted.view(-1))
        self.mirror.write(
            torch.where(emitted, reported[:, None], 0).view(-1),
            tokens_out,
            (first[:, None] + self.columns[None, :] + 1).view(-1),
            accept_len=accept_len,
        )

    def _draft(self, v, R: int, slots: torch.Tensor, positions: torch.Tensor, base: torch.Tensor) -> Drafts:
        """Speculation: record every known token in the history (prompt chunks and each decode
        span's current token, not the drafts, which may be rejected), propose k drafts for the
        verify spans and place them after their current token in the flat batch."""
        k = self.spec.k
        is_draft = v.span_verify.index_select(0, v.token_span).bool() & (v.token_offset > 0)
        self.history.write_tokens(torch.where(is_draft, 0, slots), positions, v.ids[: positions.shape[0]])
        drafts = propose(self.history, v.span_slot[:R], base[:R] + 1, k, self.spec.min_n, self.spec.max_n,
                         out=Drafts(self.drafts.tokens[:R], self.drafts.num_drafts[:R]))
        verify = v.span_verify[:R].bool()
        drafts.num_drafts.mul_(verify)
        where = torch.where(verify[:, None], v.span_q_start[:R, None] + 1 + self.columns[None, :k], self.scratch)
        v.ids.index_copy_(0, where.view(-1), drafts.tokens.view(-1))
        return drafts
