"""Host mirror: per-iteration values the CPU needs (sampled tokens, seq lens, accept lengths,
confidence), written by captured device code into a mapped pinned ring and read by the CPU
one or more iterations late, without ever blocking the GPU (docs/design.md §2.6-2.7).

Lag model. Iteration i's write lands in ring slot `i % depth`, chosen on the device by a
counter the mirror owns (a Python int would be frozen into the graph). The host records an
event per iteration right after launching it, and reads iteration i once that event fired.
Iteration i + depth reuses i's ring slot, so i is readable only while fewer than `depth`
iterations were launched after it: size `depth >= (launched iteration - read iteration) + 1`.
An overlap loop that launches N, then reads N-2 (SGLang's lag) needs depth 3, the default.

A mirror is bound to its relay: each row carries its pool slot's generation at write time
(read from `relay.generation` on the device), and a reader compares it with the slot's
current generation (`relay.host_generation`), so a slot freed and given to a new request
never serves the old request's values as the new one's: those rows are `stale`.
"""

from __future__ import annotations

import os
from typing import Optional

import msgspec
import torch

from . import reference, validation
from .backend import triton_module
from .config import RelayConfig
from .reference import RingArrays
from .relay import Relay
from .runtime import Closeable, Event, PinnedRing

_ALIGN = 128  # bytes between ring arrays: whole cache lines, and 16-byte aligned for Triton
_ROW_FIELDS = ("slots", "generation", "tokens", "seq_lens", "stale", "accept_len", "confidence")


class MirrorOverrun(RuntimeError):
    """The iteration's ring slot was (or may be being) overwritten: the reader fell `depth`
    iterations behind the launches."""


class MirrorRead(msgspec.Struct, frozen=True):
    """One iteration's values for its real rows (padding dropped), as CPU copies.

    NOTE: a `stale` row's slot was given to a newer request after this iteration ran; its
    values belong to the slot's previous owner and are never that request's data. Use
    `fresh()` to drop them.
    """

    iteration: int
    slots: torch.Tensor  # [n] int64 pool slots
    generation: torch.Tensor  # [n] int64 slot generation when the iteration ran
    tokens: torch.Tensor  # [n] config token dtype
    seq_lens: torch.Tensor  # [n] config seq-len dtype
    stale: torch.Tensor  # [n] bool: generation != the slot's current generation
    accept_len: Optional[torch.Tensor] = None  # [n]
    confidence: Optional[torch.Tensor] = None  # [n, *confidence shape]

    def __len__(self) -> int:
        return self.slots.shape[0]

    def fresh(self) -> "MirrorRead":
        """The rows whose slot still belongs to the request that produced them."""
        return self._select(~self.stale)

    def _select(self, keep: torch.Tensor) -> "MirrorRead":
        rows = {name: getattr(self, name) for name in _ROW_FIELDS}
        return msgspec.structs.replace(
            self, **{name: t[keep] for name, t in rows.items() if t is not None}
        )


def _ring_fields(config: RelayConfig, depth: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every ring array, in RingArrays order; absent fields omitted."""
    rows = (depth, config.max_batch)
    fields = [
        ("stamps", torch.int64, (depth,)),
        ("counts", torch.int64, (depth,)),
        ("slots", torch.int64, rows),
        ("generation", torch.int64, rows),
        ("tokens", config.token_torch_dtype, rows),
        ("seq_lens", config.seq_len_torch_dtype, rows),
    ]
    if config.accept_len is not None:
        fields.append(("accept_len", config.accept_len.torch_dtype, rows))
    if config.confidence is not None:
        fields.append(("confidence", config.confidence.torch_dtype, (*rows, config.confidence.numel)))
    return fields


class HostMirror(Closeable, validation.Validating):
    """A ring of `depth` iterations of host-visible values, in ONE `PinnedRing` allocated here,
    bound to `relay` (its config, device and generation tables).

    Device side: `write(indices, tokens, seq_lens, ...)` (capturable, one launch on CUDA).
    Host side: `record(i, stream)` right after launching iteration i, then `poll(i)` (never
    blocks) or `wait(i)`. Size `depth >= max lag between the iteration being launched and
    the one being read + 1`. Warm-up runs advance the device counter: call `reset()` after
    warm-up and capture.

    In host mode (relay on cpu) the write runs synchronously and events are always fired.
    `use_triton` (default: on CUDA) picks the fused kernel over the torch reference, importing
    Triton then; on CPU it needs TRITON_INTERPRET=1 (the tests use it to compare the two).
    `validate=False` skips the host-side checks of `write` (they read index and value data, a
    sync) for hot paths whose slots were validated where they were assigned; for one block,
    use `with mirror.validation(False): ...`.
    """

    def __init__(self, relay: Relay, depth: int = 3, *, use_triton: Optional[bool] = None, validate: bool = True):
        if not isinstance(relay, Relay):
            raise ValueError(
                f"HostMirror takes the Relay it mirrors, e.g. HostMirror(relay, depth=3), got {type(relay).__name__}"
            )
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"HostMirror depth must be a positive int (lag + 1), got {depth!r}")
        if use_triton is not None:
            validation.require_bool("HostMirror(use_triton=...)", use_triton)
        self._init_validation(validate)
        self.relay = relay
        self.config: RelayConfig = relay.config
        self.depth = depth
        self.device = relay.device
        self.on_gpu = self.device.type == "cuda"
        use_triton = self.on_gpu if use_triton is None else use_triton
        if use_triton and not self.on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "use_triton on a CPU mirror needs TRITON_INTERPRET=1 set before importing triton"
            )
        self._write_ring = triton_module("mirror_kernels").write_ring if use_triton else reference.write_ring

        fields = _ring_fields(self.config, depth)
        offsets, end = [], 0
        for _, dtype, shape in fields:
            offsets.append(end)
            nbytes = dtype.itemsize * torch.Size(shape).numel()
            end += -(-nbytes // _ALIGN) * _ALIGN
        self._ring = PinnedRing(end, device=self.device)
        # NOTE: cudaHostAlloc memory is uninitialised; stamp -1 marks "never written".
        self._ring.host_view(torch.uint8, (end,)).zero_()
        host = {name: self._ring.host_view(dt, sh, off) for (name, dt, sh), off in zip(fields, offsets)}
        dev = {name: self._ring.device_view(dt, sh, off) for (name, dt, sh), off in zip(fields, offsets)}
        self._host = RingArrays(**{name: host.get(name) for name in RingArrays._fields})
        self._device = RingArrays(**{name: dev.get(name) for name in RingArrays._fields})
        self._host.stamps.fill_(-1)

        self._counter = torch.zeros(1, dtype=torch.int64, device=self.device)  # next iteration
        self._events = [Event(device=self.device) for _ in range(depth)]  # one per ring slot
        self._last_recorded = -1

    @property
    def last_recorded(self) -> int:
        """The last iteration passed to `record` (-1 before the first)."""
        return self._last_recorded

    # ---- device side ------------------------------------------------------------------------

    @property
    def device_ring(self) -> tuple[RingArrays, torch.Tensor]:
        """(the ring's device views, the device iteration counter), for a kernel that fuses this
        mirror's `write` into its own launch (the engine's iteration epilogue). Such a kernel
        must write exactly what `write` writes: the rows, the row count and the stamp of ring
        slot `counter % depth`, then advance the counter."""
        self._require_open()
        return self._device, self._counter

    def write(
        self,
        indices: torch.Tensor,
        tokens: torch.Tensor,
        seq_lens: torch.Tensor,
        accept_len: Optional[torch.Tensor] = None,
        confidence: Optional[torch.Tensor] = None,
    ) -> None:
        """Write this iteration's values into ring slot `counter % depth`, then bump the counter.

        indices `[bs]` pool slots (0 = padding), tokens/seq_lens/accept_len `[bs]`, confidence
        `[bs, *shape]`, any strided views; each slot's generation comes from the relay's
        device table. Values are cast on store like the relay casts them (any integer dtype
        for integer fields, any float dtype but float64 for confidence). Fixed shape in bs,
        no sync, no allocation on the Triton path: call it inside the captured graph. Outside
        capture (with validation on), bad input, or a value that does not fit the ring's
        dtype, raises before anything is written.
        """
        self._require_open()
        if self._checking():
            self._validate_write(indices, tokens, seq_lens, accept_len, confidence)
        self._write_ring(
            self._device, self._counter, indices, self.relay.generation, tokens, seq_lens, accept_len, confidence
        )

    def _validate_write(self, indices, tokens, seq_lens, accept_len, confidence) -> None:
        cfg = self.config
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise ValueError("HostMirror.write: indices must be a 1-D tensor [bs] of pool slots")
        bs = indices.shape[0]
        if bs > cfg.max_batch:
            raise ValueError(
                f"HostMirror.write: bs = {bs} exceeds max_batch = {cfg.max_batch}; "
                "raise RelayConfig.max_batch"
            )
        if indices.dtype not in validation.INDEX_DTYPES:
            raise ValueError(f"HostMirror.write: indices has dtype {indices.dtype}; it must be int32 or int64")
        if indices.device != self.device:
            raise ValueError(
                f"HostMirror.write: indices is on {indices.device}; the mirror lives on {self.device}: "
                f"move it with .to({str(self.device)!r})"
            )
        values = {"tokens": tokens, "seq_lens": seq_lens}
        for name, value in (("accept_len", accept_len), ("confidence", confidence)):
            declared = getattr(cfg, name) is not None
            if not declared and value is not None:
                raise ValueError(
                    f"HostMirror.write: the config declares no {name}; drop the argument or "
                    f"declare RelayConfig.{name}"
                )
            if declared and value is None:
                raise ValueError(f"HostMirror.write: the config declares {name}; pass {name}=")
            if declared:
                values[name] = value
        for name, value in values.items():
            validation.check_field(self.relay.field(name), value, bs, self.device, role="HostMirror.write")
        out_of_range = (indices < 0) | (indices > cfg.max_reqs)
        if bool(out_of_range.any()):
            raise IndexError(
                f"HostMirror.write: indices {indices[out_of_range].tolist()} outside "
                f"0..max_reqs = {cfg.max_reqs}"
            )

    # ---- host side --------------------------------------------------------------------------

    def record(self, iteration: int, stream) -> None:
        """Call right after launching iteration `iteration`'s work on `stream`, outside capture.
        Iterations are recorded in order 0, 1, 2, ..., one per `write` the device ran.
        NOTE: record before polling anything: a launched but unrecorded iteration may be
        overwriting a ring slot the overrun check still believes readable."""
        self._require_open()
        expected = self._last_recorded + 1
        if iteration != expected:
            raise ValueError(
                f"HostMirror.record: iterations are recorded in order; expected {expected}, got "
                f"{iteration}. Record each launched iteration once (call reset() after warm-up)"
            )
        self._events[iteration % self.depth].record(stream)
        self._last_recorded = iteration

    def poll(self, iteration: int) -> Optional[MirrorRead]:
        """Iteration `iteration`'s values if its work finished, else None; never blocks. Rows
        whose slot the relay has since admitted again come back `stale`. Raises
        MirrorOverrun if the ring slot was reused (the reader fell `depth` behind)."""
        ring_slot = self._readable_slot(iteration)
        if not self._events[ring_slot].query():
            return None
        return self._read(iteration, ring_slot)

    def wait(self, iteration: int) -> MirrorRead:
        """Like `poll`, but blocks the host until the iteration's work finished."""
        ring_slot = self._readable_slot(iteration)
        self._events[ring_slot].synchronize()
        return self._read(iteration, ring_slot)

    def _readable_slot(self, iteration: int) -> int:
        self._require_open()
        last = self._last_recorded
        if iteration < 0 or iteration > last:
            raise ValueError(
                f"HostMirror: iteration {iteration} was not recorded (last recorded: {last}); "
                "call record(iteration, stream) right after launching it"
            )
        if iteration + self.depth <= last:
            raise MirrorOverrun(
                f"HostMirror: iteration {iteration} was overwritten: depth {self.depth} keeps only "
                f"iterations {last - self.depth + 1}..{last}. Read every iteration within lag "
                f"{self.depth - 1}, or build the mirror with depth >= your lag + 1"
            )
        return iteration % self.depth

    def _read(self, iteration: int, ring_slot: int) -> MirrorRead:
        host = self._host
        stamp = int(host.stamps[ring_slot])
        if stamp != iteration:
            raise RuntimeError(
                f"HostMirror: ring slot {ring_slot} holds iteration {stamp}, expected {iteration}: "
                "the device ran a different number of writes than were recorded. Call reset() "
                "after warm-up, and write exactly once per recorded iteration"
            )
        n = int(host.counts[ring_slot])
        slots = host.slots[ring_slot, :n]  # [n] views of the ring; _select copies
        confidence = None
        if host.confidence is not None:
            confidence = host.confidence[ring_slot, :n].view(n, *self.config.confidence.shape)
        raw = MirrorRead(
            iteration=iteration,
            slots=slots,
            generation=host.generation[ring_slot, :n],
            tokens=host.tokens[ring_slot, :n],
            seq_lens=host.seq_lens[ring_slot, :n],
            stale=host.generation[ring_slot, :n] != self.relay.host_generation[slots],
            accept_len=None if host.accept_len is None else host.accept_len[ring_slot, :n],
            confidence=confidence,
        )
        return raw._select(slots != 0)  # boolean indexing copies: the ring slot may be reused

    def reset(self) -> None:
        """Start again at iteration 0 (warm-up runs advance the device counter). Outside capture;
        blocks until the device is idle, so no in-flight write lands afterwards."""
        self._require_open()
        if self.on_gpu:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("HostMirror.reset() cannot run during capture; call it after capture")
            torch.cuda.synchronize(self.device)
        self._counter.zero_()
        self._host.stamps.fill_(-1)
        self._host.counts.zero_()
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        self._last_recorded = -1

    def close(self) -> None:
        """Free the events and the ring now (waiting for the device first). NOTE: a graph
        captured with `write` keeps the ring's address: drop such graphs before closing."""
        if self.on_gpu and not self._closed:
            torch.cuda.synchronize(self.device)  # no in-flight write may land in freed memory
        for event in self._events:
            event.close()
        self._host = self._device = None  # drop our views so the ring frees at once
        self._ring.close()
        self._closed = True
