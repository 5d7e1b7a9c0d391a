"""The speculative decode iteration, captured whole, one graph per bucket (n-gram drafts):

    relay resolve (current token, seq len p) -> history append (current token at p)
        -> propose k drafts by prompt lookup -> verify: k + 1 causal query rows per request
        -> sample every row with the (seed, position) draw plain decoding would use
        -> accept the leading drafts the target agrees with
        -> history append (accepted tokens) -> relay stash + publish (one launch)
        -> host-mirror write: one mirror row per query row, the rejected ones as padding

The mirror rows are request-major: request i's accepted tokens come back as rows
i * (k + 1) + j for j < accept_len, in order, each with its own seq len, and the rejected rows
carry padding slot 0, which the reader drops. So the host appends a variable number of tokens
per request with the same loop that reads plain decode, and the mirror needs
`max_batch * (k + 1)` rows: the relay is built with that `max_batch`.

Nothing here reads a value on the host: how many tokens a request gained is a device tensor
that the relay carries to the next iteration (its seq len and next input token) and the
mirror carries to the host (to append and to check stop conditions, an iteration late).
Outputs equal non-speculative decoding's, greedy and seeded: each emitted token is the one
plain decoding would sample at that position given the same prefix.
"""

from __future__ import annotations

import msgspec
import torch

from graphrelay.capture.iteration.accept import Accepted, accept, verify_rows, verify_tokens
from graphrelay.capture.iteration.controls.state import SamplingControls
from graphrelay.capture.model.model import LlamaModel
from graphrelay.capture.iteration.ngram import Drafts, TokenHistory, propose
from graphrelay.capture.iteration.sampling import sample
from graphrelay.capture.iteration.surface import DecodeInputs
from graphrelay import Relay, RelayPayload
from graphrelay.mirror import HostMirror


class SpecConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """n-gram (prompt lookup) speculation: propose `k` tokens after the most recent earlier
    occurrence of the last n tokens, n from `max_n` down to `min_n`."""

    k: int = 4
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or not 1 <= self.k <= 16:
            raise ValueError(f"SpecConfig.k (draft tokens per iteration) must be an int in 1..16, got {self.k!r}")
        if not isinstance(self.min_n, int) or not isinstance(self.max_n, int) or not 1 <= self.min_n <= self.max_n <= 8:
            raise ValueError(f"SpecConfig needs 1 <= min_n <= max_n <= 8, got min_n={self.min_n!r} max_n={self.max_n!r}")

    @property
    def rows(self) -> int:
        """Query rows per request in the verify forward."""
        return self.k + 1


class SpecDecodeStep:
    """`step(bs)` for a speculative engine; every buffer is allocated here, at full shape."""

    def __init__(self, relay: Relay, model: LlamaModel, mirror: HostMirror, inputs: DecodeInputs,
                 history: TokenHistory, spec: SpecConfig, *, max_top_k: int | None = None,
                 controls: SamplingControls | None = None):
        cfg = relay.config
        if cfg.accepted_tokens is None or cfg.accepted_tokens.shape != (spec.rows,) or cfg.accept_len is None:
            raise ValueError(f"a speculative relay needs accepted_tokens [{spec.rows}] and accept_len fields (see Engine)")
        if cfg.max_batch != inputs.max_batch * spec.rows:
            raise ValueError(f"a speculative relay's max_batch must be inputs.max_batch * (k + 1) = "
                             f"{inputs.max_batch * spec.rows} (one mirror row per query row), got {cfg.max_batch}")
        self.relay, self.model, self.mirror, self.inputs, self.history = relay, model, mirror, inputs, history
        self.spec, self.max_top_k, self.controls = spec, max_top_k, controls
        device, rows = relay.device, cfg.max_batch
        batch = inputs.max_batch
        self.resolved = relay.alloc_resolved(batch, dtypes={"tokens": torch.int64})
        self.drafts = Drafts(torch.zeros((batch, spec.k), dtype=torch.int64, device=device),
                             torch.zeros(batch, dtype=torch.int64, device=device))
        self.accepted = Accepted(torch.zeros((batch, spec.rows), dtype=torch.int64, device=device),
                                 torch.zeros(batch, dtype=torch.int64, device=device))
        self.logits = torch.zeros((rows, model.config.vocab_size), dtype=torch.float32, device=device)
        self.target = torch.zeros(rows, dtype=torch.int64, device=device)
        self.ones = torch.ones(batch, dtype=torch.int64, device=device)
        self.columns = torch.arange(spec.rows, device=device)  # [k + 1]

    def __call__(self, bs: int) -> None:
        k, rows, max_seq_len = self.spec.k, self.spec.rows, self.model.config.max_seq_len
        inputs = self.inputs.narrow(bs)
        resolved = self.relay.resolve(inputs.slots, out=self.resolved.narrow(bs), fields=("tokens", "seq_lens"))
        current, position = resolved.tokens, resolved.seq_lens  # [bs]: the token at position p
        self.history.append(inputs.slots, position, current[:, None], self.ones[:bs])
        drafts = propose(self.history, inputs.slots, position + 1, k, self.spec.min_n, self.spec.max_n,
                         out=Drafts(self.drafts.tokens[:bs], self.drafts.num_drafts[:bs]))
        verify = verify_rows(inputs.slots, position, k, max_seq_len)  # [bs * rows] each
        logits = self.model.decode(verify_tokens(current, drafts.tokens), verify.slots, verify.positions,
                                   out=self.logits[: bs * rows])

        def per_row(t: torch.Tensor) -> torch.Tensor:  # [bs] -> [bs * rows], request-major
            return t[:, None].expand(bs, rows).reshape(-1)

        raw_logits = logits
        if self.controls is not None:
            # Row j is controlled as if drafts 0..j-1 were already emitted: their counts and the
            # automaton state after them, so an accepted row saw what plain decoding would.
            logits, row_states = self.controls.before_sample(logits, verify.slots, verify.positions,
                                                             *self.controls.span_rows(inputs.slots, drafts.tokens))

        # The draw at query row j uses step p + j: what plain decoding uses at that position.
        target = sample(logits, per_row(inputs.temperature), per_row(inputs.top_k), per_row(inputs.seeds),
                        verify.positions, out=self.target[: bs * rows], max_top_k=self.max_top_k,
                        top_p=per_row(inputs.top_p))
        accepted = accept(drafts.tokens, drafts.num_drafts, target.view(bs, rows),
                          out=Accepted(self.accepted.tokens[:bs], self.accepted.accept_len[:bs]))
        self.history.append(inputs.slots, position + 1, accepted.tokens, accepted.accept_len)
        next_token = accepted.tokens.gather(1, (accepted.accept_len - 1)[:, None])[:, 0]  # [bs]
        new_seq_lens = position + accepted.accept_len
        self.relay.stash_and_publish(
            inputs.slots,
            RelayPayload(tokens=next_token, accepted_tokens=accepted.tokens, accept_len=accepted.accept_len),
            new_seq_lens,
        )
        emitted = self.columns[None, :] < accepted.accept_len[:, None]  # [bs, k + 1]
        if self.controls is not None:
            self.controls.after_sample(verify.slots, raw_logits, target, row_states, emitted.view(-1))
        self.mirror.write(
            torch.where(emitted, inputs.slots[:, None], 0).view(-1),
            accepted.tokens.view(-1),
            (position[:, None] + self.columns[None, :] + 1).view(-1),
            accept_len=per_row(accepted.accept_len),
        )
