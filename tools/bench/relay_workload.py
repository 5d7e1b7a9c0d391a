"""What the relay benchmark runs: static inputs, the iteration of each relay, and the check
that both relays compute the same thing.

One iteration is what a decode step asks of the relay: resolve this batch's slots (the values
the previous step left), then stash and publish the values this step produced. Inputs are
random (never zeros, which hide unwritten outputs) and preallocated; each iteration uses one
of a few index sets in turn, so consecutive iterations touch different rows.
"""

from __future__ import annotations

from typing import Optional, Sequence

import msgspec
import torch

from graphrelay.fields import PUBLISH, STASH, Field, RelayPayload, Resolved
from graphrelay.relay import Relay
from graphrelay.tools.bench.baseline import PerFieldRelay
from graphrelay.tools.bench.timing import Step

VOCAB = 32000  # token ids and top-k indices are drawn below this


class StepInputs(msgspec.Struct):
    """What one decode step hands the relay: `[bs, *shape]` tensors in storage dtypes."""

    payload: RelayPayload
    seq_lens: torch.Tensor  # [bs]
    confidence: Optional[torch.Tensor] = None  # [bs, num_draft] when the config declares it


def random_inputs(fields: Sequence[Field], batch: int, device: torch.device, gen: torch.Generator) -> StepInputs:
    values = {}
    for f in fields:
        shape = (batch, *f.shape)
        if f.is_float:
            value = torch.randn(shape, generator=gen)
        else:
            value = torch.randint(1, VOCAB, shape, generator=gen)
        values[f.name] = value.to(device=device, dtype=f.dtype)
    payload = RelayPayload(**{f.name: values[f.name] for f in fields if f.group == STASH})
    publish = {f.name: values[f.name] for f in fields if f.group == PUBLISH}
    return StepInputs(payload, publish["seq_lens"], publish.get("confidence"))


def padding_rows(batch: int) -> int:
    """Rows of a bucket left to padding slot 0: an eighth, as when a batch is padded up."""
    return batch // 8


def index_sets(count: int, batch: int, max_reqs: int, device: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    """`count` buckets of `batch` int64 slots: distinct random live slots, then padding 0s."""
    live = batch - padding_rows(batch)
    if live > max_reqs:
        raise ValueError(f"a bucket of {batch} needs {live} live slots but max_reqs is {max_reqs}")
    sets = []
    for _ in range(count):
        slots = torch.randperm(max_reqs, generator=gen)[:live] + 1
        sets.append(torch.cat([slots, torch.zeros(batch - live, dtype=torch.int64)]).to(device))
    return sets


def fill_every_row(relays: Sequence[Relay | PerFieldRelay], fields: Sequence[Field], max_reqs: int, max_batch: int,
                   device: torch.device, gen: torch.Generator) -> None:
    """Stash and publish the same random values into every slot of each relay, so gathers read
    real data and both relays start equal."""
    for start in range(1, max_reqs + 1, max_batch):
        slots = torch.arange(start, min(start + max_batch, max_reqs + 1), device=device)
        inputs = random_inputs(fields, slots.shape[0], device, gen)
        for relay in relays:
            # The fused op on graphrelay: the specialization the benchmark times, so Triton
            # compiles nothing it will not use.
            relay.stash_and_publish(slots, inputs.payload, inputs.seq_lens, inputs.confidence)


def relay_step(relay: Relay | PerFieldRelay, sets: Sequence[torch.Tensor], inputs: StepInputs,
               out: Optional[Resolved] = None) -> Step:
    """One iteration: resolve, then stash + publish. graphrelay gathers into the static `out`
    (one fused launch each way); the per-field baseline allocates its gathers, as SGLang does
    (one indexing op per field each way)."""
    resolve = relay.resolve if out is None else (lambda indices: relay.resolve(indices, out=out))

    def step(k: int) -> None:
        indices = sets[k % len(sets)]
        resolve(indices)
        relay.stash_and_publish(indices, inputs.payload, inputs.seq_lens, inputs.confidence)

    return step


def disagreements(relay: Relay, baseline: PerFieldRelay, indices: torch.Tensor, inputs: StepInputs) -> list[str]:
    """Run one iteration on both relays and name every field whose live gathered rows or rows 1..max_reqs differ."""
    live = indices != 0
    ours, theirs = relay.resolve(indices), baseline.resolve(indices)
    for each in (relay, baseline):
        each.stash_and_publish(indices, inputs.payload, inputs.seq_lens, inputs.confidence)
    bad = []
    for f in relay.fields:
        if not torch.equal(getattr(ours, f.name)[live], getattr(theirs, f.name)[live]):
            bad.append(f"resolve.{f.name}")
        if not torch.equal(relay.buffers[f.name][1:], baseline.buffers[f.name][1:]):
            bad.append(f"buffer.{f.name}")
    return bad
