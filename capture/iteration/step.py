"""The decode step that is captured whole, one graph per bucket:

    relay resolve (tokens, seq lens) -> model decode -> sampling
        -> relay stash + publish (one launch) -> host-mirror write

Every buffer it touches is allocated here or by its parts before capture; `step(bs)` only
reads and writes `[:bs]` views of them, so it syncs nothing and allocates nothing that a
replay would need again.
"""

from __future__ import annotations

import torch

from graphrelay.capture.model.model import LlamaModel
from graphrelay.capture.iteration.controls.state import SamplingControls
from graphrelay.capture.iteration.sampling import sample
from graphrelay.capture.iteration.surface import DecodeInputs
from graphrelay import Relay, RelayPayload
from graphrelay.mirror import HostMirror


class DecodeStep:
    """Binds a relay, a model, a host mirror and the static input surface into `step(bs)`.

    The relay must be built with `validate=False` and the mirror with `validate=False`:
    their host-side checks read values (a sync) and the step runs under sync-debug "error"
    during warm-up. Slots are validated where the scheduler assigns them.
    """

    def __init__(self, relay: Relay, model: LlamaModel, mirror: HostMirror, inputs: DecodeInputs, *, max_top_k: int | None = None,
                 controls: SamplingControls | None = None):
        cfg = relay.config
        if inputs.max_batch != cfg.max_batch:
            raise ValueError(f"inputs.max_batch {inputs.max_batch} must equal RelayConfig.max_batch {cfg.max_batch}")
        if model.max_reqs != cfg.max_reqs:
            raise ValueError(f"model.max_reqs {model.max_reqs} must equal RelayConfig.max_reqs {cfg.max_reqs}")
        self.relay, self.model, self.mirror, self.inputs = relay, model, mirror, inputs
        self.max_top_k = max_top_k
        self.controls = controls
        device = relay.device
        # Static outputs of the step, [max_batch, ...]; views [:bs] per bucket.
        self.resolved = relay.alloc_resolved()
        self.logits = torch.zeros((cfg.max_batch, model.config.vocab_size), dtype=torch.float32, device=device)
        self.next_tokens = torch.zeros(cfg.max_batch, dtype=torch.int64, device=device)
        self.new_seq_lens = torch.zeros(cfg.max_batch, dtype=cfg.seq_len_torch_dtype, device=device)

    def __call__(self, bs: int) -> None:
        inputs = self.inputs.narrow(bs)
        resolved = self.relay.resolve(inputs.slots, out=self.resolved.narrow(bs))
        logits = self.model.decode(resolved.tokens, inputs.slots, resolved.seq_lens, out=self.logits[:bs])
        raw_logits = logits
        if self.controls is not None:
            logits, row_states = self.controls.before_sample(logits, inputs.slots, resolved.seq_lens)
        # The request's position is its sampling step: the same (seed, position) draws the same
        # token in every mode and batch composition.
        tokens = sample(
            logits, inputs.temperature, inputs.top_k, inputs.seeds, resolved.seq_lens,
            out=self.next_tokens[:bs], max_top_k=self.max_top_k, top_p=inputs.top_p,
        )
        if self.controls is not None:
            self.controls.after_sample(inputs.slots, raw_logits, tokens, row_states)
        new_seq_lens = torch.add(resolved.seq_lens, 1, out=self.new_seq_lens[:bs])
        self.relay.stash_and_publish(inputs.slots, RelayPayload(tokens=tokens), new_seq_lens)
        self.mirror.write(inputs.slots, tokens, new_seq_lens)
