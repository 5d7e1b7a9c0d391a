"""Host mirror: per-iteration values the CPU needs (sampled tokens, seq lens, accept lengths,
confidence), written by captured device code into a mapped pinned ring and read by the CPU
one or more iterations late, without ever blocking the GPU (DESIGN.md §2.6-2.7).

Lag model. Iteration i's write lands in ring slot `i % depth`, chosen on the device by a
counter the mirror owns (a Python int would be frozen into the graph). The host records an
event per iteration right after launching it, and reads iteration i once that event fired.
Iteration i + depth reuses i's ring slot, so i is readable only while fewer than `depth`
iterations were launched after it: size `depth >= (launched iteration - read iteration) + 1`.
An overlap loop that launches N, then reads N-2 (SGLang's lag) needs depth 3, the default.

Each row carries its pool slot's generation at write time; a reader compares it with the
slot's current generation (`relay.host_generation`), so a slot freed and given to a new
request never serves the old request's values as the new one's: those rows are `stale`.
"""

from __future__ import annotations

import os
from typing import Optional

import msgspec
import torch

from .config import RelayConfig
from .mirror_kernels import RingArrays, write_ring_torch, write_ring_triton
from .runtime import Closeable, Event, PinnedRing, resolve_device

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


def _is_int(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


class HostMirror(Closeable):
    """A ring of `depth` iterations of host-visible values, in ONE `PinnedRing` allocated here.

    Device side: `write(...)` (capturable, one launch on CUDA). Host side: `record(i, stream)`
    right after launching iteration i, then `poll(i, gen)` (never blocks) or `wait(i, gen)`.
    Size `depth >= max lag between the iteration being launched and the one being read + 1`.
    Warm-up runs advance the device counter: call `reset()` after warm-up and capture.

    In host mode (device cpu) the write runs synchronously and events are always fired.
    `use_triton` (default: on CUDA) picks the fused kernel over the torch reference; on CPU
    it needs TRITON_INTERPRET=1 (the tests use it to compare the two). `validate=False` skips
    the host-side checks of `write` (they read index values, a sync) for hot paths whose
    slots were validated where they were assigned.
    """

    def __init__(
        self,
        config: RelayConfig,
        device,
        depth: int = 3,
        use_triton: Optional[bool] = None,
        validate: bool = True,
    ):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"HostMirror depth must be a positive int (lag + 1), got {depth!r}")
        self.config = config
        self.depth = depth
        self.validate = validate
        self.device = resolve_device(device)
        self.on_gpu = self.device.type == "cuda"
        use_triton = self.on_gpu if use_triton is None else use_triton
        if use_triton and not self.on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "use_triton on a CPU mirror needs TRITON_INTERPRET=1 set before importing triton"
            )
        self._write_ring = write_ring_triton if use_triton else write_ring_torch

        fields = _ring_fields(config, depth)
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

    def write(
        self,
        indices: torch.Tensor,
        generation: torch.Tensor,
        tokens: torch.Tensor,
        seq_lens: torch.Tensor,
        accept_len: Optional[torch.Tensor] = None,
        confidence: Optional[torch.Tensor] = None,
    ) -> None:
        """Write this iteration's values into ring slot `counter % depth`, then bump the counter.

        indices `[bs]` pool slots (0 = padding), generation `[max_reqs + 1]` int64 (the relay's
        device generation table, gathered at `indices`), tokens/seq_lens/accept_len `[bs]`,
        confidence `[bs, *shape]`. Fixed shape in bs, no sync, no allocation on the Triton
        path: call it inside the captured graph. Outside capture, bad input raises before
        anything is written.
        """
        self._require_open()
        if self.validate and not (self.on_gpu and torch.cuda.is_current_stream_capturing()):
            self._validate(indices, generation, tokens, seq_lens, accept_len, confidence)
        self._write_ring(
            self._device, self._counter, indices, generation, tokens, seq_lens, accept_len, confidence
        )

    def _validate(self, indices, generation, tokens, seq_lens, accept_len, confidence) -> None:
        cfg = self.config
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise ValueError("HostMirror.write: indices must be a 1-D tensor [bs] of pool slots")
        bs = indices.shape[0]
        if bs > cfg.max_batch:
            raise ValueError(
                f"HostMirror.write: bs = {bs} exceeds max_batch = {cfg.max_batch}; "
                "raise RelayConfig.max_batch"
            )
        is_index = lambda t: t.dtype in (torch.int32, torch.int64)  # noqa: E731
        self._expect("indices", indices, (bs,), is_index, "int32 or int64")
        self._expect("generation", generation, (cfg.rows,), lambda t: t.dtype == torch.int64,
                     "int64 (the relay's generation table)")
        self._expect("tokens", tokens, (bs,), _is_int, "an integer dtype")
        self._expect("seq_lens", seq_lens, (bs,), _is_int, "an integer dtype")
        if self._expect_declared("accept_len", accept_len, cfg.accept_len):
            self._expect("accept_len", accept_len, (bs,), _is_int, "an integer dtype")
        if self._expect_declared("confidence", confidence, cfg.confidence):
            # NOTE: no float cast on store: rounding modes differ (the Triton interpreter
            # truncates to bfloat16), so the ring would not be bit-exact across paths.
            dtype = cfg.confidence.torch_dtype
            self._expect("confidence", confidence, (bs, *cfg.confidence.shape),
                         lambda t: t.dtype == dtype, f"{dtype} (the config's dtype): cast it in the step")
        out_of_range = (indices < 0) | (indices > cfg.max_reqs)
        if bool(out_of_range.any()):
            raise IndexError(
                f"HostMirror.write: indices {indices[out_of_range].tolist()} outside "
                f"0..max_reqs = {cfg.max_reqs}"
            )

    def _expect(self, name, value, shape, dtype_ok, dtype_hint) -> None:
        where = f"HostMirror.write: {name}"
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where} must be a tensor, got {type(value).__name__}")
        if value.device != self.device:
            raise ValueError(
                f"{where} is on {value.device}; the mirror lives on {self.device}: "
                f"move it with .to({str(self.device)!r})"
            )
        if tuple(value.shape) != shape:
            raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {shape}")
        if not dtype_ok(value):
            raise ValueError(f"{where} has dtype {value.dtype}; it must be {dtype_hint}")
        if not value.is_contiguous():
            raise ValueError(f"{where} must be contiguous: pass {name}.contiguous()")

    @staticmethod
    def _expect_declared(name, value, spec) -> bool:
        """Whether an optional field is to be checked; raises if the config disagrees."""
        if spec is None and value is not None:
            raise ValueError(
                f"HostMirror.write: the config declares no {name}; drop the argument or "
                f"declare RelayConfig.{name}"
            )
        if spec is not None and value is None:
            raise ValueError(f"HostMirror.write: the config declares {name}; pass {name}=")
        return value is not None

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

    def poll(self, iteration: int, current_generation: torch.Tensor) -> Optional[MirrorRead]:
        """Iteration `iteration`'s values if its work finished, else None; never blocks.
        `current_generation` is the CPU int64 `[max_reqs + 1]` table (`relay.host_generation`).
        Raises MirrorOverrun if the ring slot was reused (the reader fell `depth` behind)."""
        ring_slot = self._readable_slot(iteration)
        if not self._events[ring_slot].query():
            return None
        return self._read(iteration, ring_slot, current_generation)

    def wait(self, iteration: int, current_generation: torch.Tensor) -> MirrorRead:
        """Like `poll`, but blocks the host until the iteration's work finished."""
        ring_slot = self._readable_slot(iteration)
        self._events[ring_slot].synchronize()
        return self._read(iteration, ring_slot, current_generation)

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

    def _read(self, iteration: int, ring_slot: int, current_generation: torch.Tensor) -> MirrorRead:
        rows = self.config.rows
        if (
            not isinstance(current_generation, torch.Tensor)
            or current_generation.device.type != "cpu"
            or current_generation.dtype != torch.int64
            or tuple(current_generation.shape) != (rows,)
        ):
            raise ValueError(
                f"HostMirror: current_generation must be a CPU int64 [{rows}] tensor "
                "(relay.host_generation), not the device table"
            )
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
            stale=host.generation[ring_slot, :n] != current_generation[slots],
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
