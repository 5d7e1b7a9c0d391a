"""The plain iteration's epilogue in one launch: relay stash + publish of the sampled tokens and
the host-mirror write, after sampling.

For a step without speculation or sampling controls, sampled row r is span r's, and the step's
glue after sampling is (`capture.iteration.step`):

    reported = span_samples[r] ? span_slot[r] : 0
    relay.stash_and_publish(reported, RelayPayload(tokens=target), row_positions + 1)
    mirror.write(row_live[r] ? reported : 0, target, row_positions + 1)

~11 graph nodes. `stash_publish_mirror` writes exactly what those library calls write -- the
relay rows (an out-of-range slot clamped to padding row 0, and row 0 never written, as
`graphrelay.kernels.scatter_kernel` does), then the mirror's ring slot `counter % depth`: each
row's slot, that slot's generation, token and seq len, the row count and the stamp, and the
counter advanced (`graphrelay.mirror_kernels`) -- in ONE program, since the counter is read
and bumped in the same launch. Given the sampler's chunk results (`sample_chunks`), the same
program first runs the sampler's last pass (`pick_rows`) and writes the tokens into `target`:
the relay and the mirror then cost no graph node of their own. The step keeps the glue for
speculation, on the CPU, and for a relay in debug mode (its consume-once bookkeeping lives in
its own scatter); with controls it fuses the epilogue but not the pick, since the controls read
the tokens before the mirror write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from graphrelay.capture.kernels.sampling_kernel import ChunkResults, pick_rows
from graphrelay.kernels import to_dtype

if TYPE_CHECKING:
    from graphrelay import Relay
    from graphrelay.mirror import HostMirror

_BLOCK = 128  # rows per pass of the one program


def check_fusable(relay: "Relay", mirror: "HostMirror") -> None:
    """ValueError unless the fused epilogue writes everything `stash_and_publish` and `write`
    would: a plain relay (tokens and seq lens only) outside debug mode, its own mirror."""
    names = tuple(f.name for f in relay.fields)
    if names != ("tokens", "seq_lens"):
        raise ValueError(f"the fused epilogue stashes tokens and publishes seq lens only; this relay carries {names}")
    if relay.debug:
        raise ValueError("a relay in debug mode checks its writes in its own scatter: keep the step's glue")
    if mirror.relay is not relay:
        raise ValueError("the mirror must be bound to the relay the epilogue writes")


def stash_publish_mirror(relay: "Relay", mirror: "HostMirror", span_slot: torch.Tensor, span_samples: torch.Tensor,
                         row_live: torch.Tensor, target: torch.Tensor, row_positions: torch.Tensor,
                         picks: ChunkResults | None = None) -> None:
    """One plain iteration's relay stash + publish and mirror write (module docstring).

    span_slot, span_samples [>= S] and row_live, target, row_positions [S] int64, contiguous,
    on the relay's device; S = the sampled rows (one per span). picks: the sampler's chunk
    results for those S rows; the tokens are then picked here and written into `target`, else
    `target` holds them. Capturable: one launch, no host read, nothing allocated. Call
    `check_fusable` once first."""
    ring, counter = mirror.device_ring
    rows = target.shape[0]
    if picks is not None and picks.chunk_max.shape[0] != rows:
        raise ValueError(f"picks hold {picks.chunk_max.shape[0]} rows, target {rows}")
    # Without picks, `target` stands in for the chunk results the kernel then never reads.
    chunk = picks if picks is not None else ChunkResults(target, target[:, None], target[:, None], target[:, None],
                                                        target[:, None])
    _epilogue_kernel[(1,)](
        span_slot, span_samples, row_live, target, row_positions,
        chunk.temperature, chunk.temperature.stride(0), chunk.chunk_max, chunk.chunk_arg, chunk.score,
        chunk.score_arg, chunk.n_chunks,
        relay.buffers["tokens"], relay.buffers["seq_lens"], relay.generation,
        counter, ring.stamps, ring.counts, ring.slots, ring.generation, ring.tokens, ring.seq_lens,
        mirror.depth, ring.slots.shape[1], relay.config.max_reqs,
        BLOCK=min(triton.next_power_of_2(rows), _BLOCK), ROWS=rows, PICK=picks is not None, CHUNKS=chunk.chunks,
    )


@triton.jit
def _epilogue_kernel(
    span_slot_ptr, span_samples_ptr,  # [R + 1] int64
    row_live_ptr, target_ptr, row_positions_ptr,  # [S] int64
    temperature_ptr, temperature_stride, chunk_max_ptr, chunk_arg_ptr, score_ptr, score_arg_ptr, n_chunks,  # PICK
    relay_tokens_ptr, relay_seq_lens_ptr,  # [max_reqs + 1] the relay's rows
    generation_ptr,  # [max_reqs + 1] int64: the relay's device generations
    counter_ptr, stamps_ptr, counts_ptr,  # [1], [depth], [depth] int64
    ring_slots, ring_generation, ring_tokens, ring_seq_lens,  # [depth, max_batch]
    depth, max_batch, max_reqs,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,  # S: a static loop (the interpreter cannot loop to a runtime bound)
    PICK: tl.constexpr,  # pick the tokens from the sampler's chunk results and write them to target
    CHUNKS: tl.constexpr,
):
    iteration = tl.load(counter_ptr)
    ring_slot = iteration % depth
    ring_base = ring_slot * max_batch
    for start in tl.static_range(0, ROWS, BLOCK):
        r = start + tl.arange(0, BLOCK)
        live = r < ROWS
        samples = tl.load(span_samples_ptr + r, mask=live, other=0) != 0
        reported = tl.where(samples, tl.load(span_slot_ptr + r, mask=live, other=0), 0)
        if PICK:
            token = pick_rows(r.to(tl.int64), live, temperature_ptr, temperature_stride, chunk_max_ptr, chunk_arg_ptr,
                              score_ptr, score_arg_ptr, n_chunks, CHUNKS)
            tl.store(target_ptr + r, token, mask=live)
        else:
            token = tl.load(target_ptr + r, mask=live, other=0)
        seq_len = tl.load(row_positions_ptr + r, mask=live, other=0) + 1
        in_range = (reported >= 0) & (reported <= max_reqs)
        relay_row = tl.where(in_range, reported, 0)
        written = live & (relay_row != 0)  # padding row 0 keeps its fill values
        tl.store(relay_tokens_ptr + relay_row, to_dtype(token, relay_tokens_ptr.dtype.element_ty), mask=written)
        tl.store(relay_seq_lens_ptr + relay_row, to_dtype(seq_len, relay_seq_lens_ptr.dtype.element_ty),
                 mask=written)
        shown = tl.where(tl.load(row_live_ptr + r, mask=live, other=0) != 0, reported, 0)
        tl.store(ring_slots + ring_base + r, shown, mask=live)
        # A slot the scheduler would never assign reads row 0's generation, not memory past the table.
        tl.store(ring_generation + ring_base + r, tl.load(generation_ptr + tl.where(in_range, shown, 0), mask=live),
                 mask=live)
        tl.store(ring_tokens + ring_base + r, to_dtype(token, ring_tokens.dtype.element_ty), mask=live)
        tl.store(ring_seq_lens + ring_base + r, to_dtype(seq_len, ring_seq_lens.dtype.element_ty), mask=live)
    tl.store(counts_ptr + ring_slot, ROWS)
    tl.store(stamps_ptr + ring_slot, iteration)
    tl.store(counter_ptr, iteration + 1)
