"""The decode engine: relay, model, host mirror, input surface and captured graphs, built once.

The engine owns the device side of serving and exposes what a scheduler needs, all
non-blocking: `prefill` a batch of prompt chunks and `launch` a decode iteration, each an
iteration whose sampled tokens come back the same way, through `read` (poll or wait) of the
host mirror. Everything is ordered on one stream the engine creates with cuda-python.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence

import msgspec

import torch

from graphrelay.capture.iteration.buckets import default_buckets
from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig, SamplingControls
from graphrelay.capture.iteration.graph_runner import CaptureReport, GraphRunner
from graphrelay.capture.model.memory_plan import check_fits, plan_memory
from graphrelay.capture.model.model import LlamaModel, ModelConfig, ModelWeights
from graphrelay.capture.iteration.ngram import TokenHistory
from graphrelay.capture.iteration.sampling import sample
from graphrelay.capture.iteration.spec_step import SpecConfig, SpecDecodeStep
from graphrelay.capture.iteration.step import DecodeStep
from graphrelay.capture.serving.sync_count import HostSyncCounter
from graphrelay.capture.iteration.surface import DecodeInputs, HostBatch, PrefillChunk
from graphrelay.capture.parallel.tensor_parallel import Command, LaunchCommand, PrefillCommand, StopCommand, TensorParallel
from graphrelay import FieldSpec, Relay, RelayConfig, RelayPayload
from graphrelay.mirror import HostMirror, MirrorRead
from graphrelay.runtime import Stream, to_device_async


WARM_PREFILL_TOKENS = 16  # the longest warm-up chunk (capped at the model's max_seq_len)


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything an `Engine` is sized by, validated where it is built.

    use_graphs: capture one CUDA graph per bucket (GPU only); otherwise the step runs
    eagerly on the same padded buckets, so both modes see identical shapes. buckets: the
    batch sizes captured (default: dense small, coarse large, up to max_batch).
    """

    model: ModelConfig
    max_reqs: int
    max_batch: int
    device: str = "cpu"
    use_graphs: bool = True
    buckets: Optional[tuple[int, ...]] = None
    max_top_k: Optional[int] = 64
    mirror_depth: int = 3
    prefill_tokens: int = 2048
    spec: Optional[SpecConfig] = None
    debug: bool = False
    controls: Optional[ControlsConfig] = None  # None: no sampling controls in the graphs

    def __post_init__(self) -> None:
        for name in ("max_reqs", "max_batch", "mirror_depth", "prefill_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_top_k is not None and (not isinstance(self.max_top_k, int) or self.max_top_k < 1):
            raise ValueError(f"EngineConfig.max_top_k must be None or a positive int, got {self.max_top_k!r}")

    @property
    def decode_rows(self) -> int:
        """Query rows of the largest decode step: k + 1 per request when speculating."""
        return self.max_batch * (self.spec.rows if self.spec else 1)


class Engine:
    """Everything one decode iteration touches, allocated up front from one `EngineConfig`:
    relay, model, host mirror, input surface, step and graph runner. The CLI, the benchmarks,
    the tests and the lint targets all build through it.

    weights: the model's real weights, whole (None: seeded random ones). progress: print
    capture progress. tp: this process's rank in a tensor-parallel group: every rank builds
    the same engine over its shard of the model; rank 0's `prefill` and `launch` also send
    the command to the others, which run it from `follow` (see `capture.tensor_parallel`).
    """

    def __init__(self, config: EngineConfig, *, weights: Optional[ModelWeights] = None, progress: bool = False,
                 tp: Optional[TensorParallel] = None):
        self.config = config
        self.tp = tp
        model_config, max_reqs, max_batch, spec = config.model, config.max_reqs, config.max_batch, config.spec
        max_top_k, prefill_tokens = config.max_top_k, config.prefill_tokens
        self.device = torch.device(config.device)
        self.on_gpu = self.device.type == "cuda"
        # Speculative decoding verifies k + 1 query rows per request and reports each through
        # its own mirror row, so the relay (whose max_batch sizes the mirror) and the model's
        # decode buffers hold that many rows.
        rows = config.decode_rows
        check_fits(plan_memory(model_config.shard(tp.world if tp else 1), max_reqs, rows, prefill_tokens), self.device)
        extra = {}
        if spec is not None:
            extra = dict(accepted_tokens=FieldSpec((spec.rows,), "int32"), accept_len=FieldSpec((), "int32"))
        relay_config = RelayConfig.plain(max_reqs, rows, debug=config.debug, **extra)
        self.relay = Relay(relay_config, self.device, validate=False)
        self.model = LlamaModel(model_config, max_reqs, self.device, weights=weights, max_decode_rows=rows, tp=tp)
        self.mirror = HostMirror(self.relay, depth=config.mirror_depth, validate=False)
        self.inputs = DecodeInputs(max_batch, self.device)
        self.history = None
        self.controls = None
        if config.controls is not None:
            if tp is not None:
                raise ValueError("EngineConfig.controls are not wired through tensor parallelism yet; drop --tp or the controls")
            self.controls = SamplingControls(config.controls, max_reqs, model_config.vocab_size, rows, self.device,
                                             mirror_depth=config.mirror_depth)
        if spec is None:
            self.step = DecodeStep(self.relay, self.model, self.mirror, self.inputs, max_top_k=max_top_k,
                                   controls=self.controls)
        else:
            self.history = TokenHistory(max_reqs, model_config.max_seq_len, self.device)
            self.step = SpecDecodeStep(self.relay, self.model, self.mirror, self.inputs, self.history, spec,
                                       max_top_k=max_top_k, controls=self.controls)
        self.runner = GraphRunner(
            self.step, list(config.buckets) if config.buckets else default_buckets(max_batch), max_batch, self.device,
            use_graphs=config.use_graphs, progress=progress and (tp is None or tp.leads),
            # NCCL's watchdog thread queries events while the graphs capture: only the capturing
            # thread's calls may be checked, or its legal queries would invalidate the capture.
            capture_error_mode="thread_local" if tp is not None and tp.world > 1 else "global",
        )
        # One stream orders everything: created with cuda-python, handed to torch once (an
        # ExternalStream over the same handle) for the torch work queued on it. Persistent:
        # pinned tensors copied on it may outlive this engine (see Stream.persistent).
        self.stream = Stream.persistent(self.device)
        self.torch_stream = self.stream.as_torch() if self.on_gpu else None
        self.iterations_launched = 0
        if self.on_gpu:
            # The engine stream does not order against the legacy default stream that built
            # the weights: finish construction before any work is queued on it.
            torch.cuda.synchronize(self.device)

    @property
    def max_batch(self) -> int:
        """The most requests one decode iteration runs."""
        return self.inputs.max_batch

    @property
    def uses_graphs(self) -> bool:
        """Whether iterations replay captured graphs (after `capture`, on a GPU, with graphs on)."""
        return bool(self.runner.graphs)

    @property
    def max_reqs(self) -> int:
        return self.relay.config.max_reqs

    def activate(self):
        """Context manager making the engine stream current for torch work (GPU), or a no-op.
        `prefill` and `launch` refuse to run outside it."""
        return torch.cuda.stream(self.torch_stream) if self.on_gpu else nullcontext()

    def capture(self) -> CaptureReport:
        """Warm up and capture every bucket, warm prefill up, then restart the mirror at
        iteration 0."""
        with self.activate():
            report = self.runner.capture()
            self._warm_up_prefill()
        self.mirror.reset()
        if self.controls is not None and self.controls.logprobs is not None:
            self.controls.logprobs.reset()
        self.iterations_launched = 0
        return report

    @torch.no_grad()
    def _warm_up_prefill(self) -> None:
        """Run prefill's forward and sampling once per kind of shape (a token count divisible
        by 16 or not), so their kernels compile here and not in the first request's time to
        first token. Only the model's cache rows of slots 1.. are written, which their next
        request overwrites before reading; the relay, the mirror and the slots' generations
        are untouched."""
        longest = min(WARM_PREFILL_TOKENS, self.model.config.max_seq_len)
        for lengths in ([longest], [max(1, longest - 3), 1][: self.max_reqs]):
            logits = self.model.prefill(list(range(1, len(lengths) + 1)), [[0] * n for n in lengths])
            n = logits.shape[0]
            zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
            ones = torch.ones(n, dtype=torch.float32, device=self.device)
            if self.controls is not None:  # padding rows: reads the tables, writes only its outputs
                logits = self.controls.apply(logits, zeros, zeros, self.controls.row_states(zeros))
            sample(logits, ones, zeros, zeros, zeros, top_p=ones * 0.9, max_top_k=self.config.max_top_k)

    @torch.no_grad()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> int:
        """Queue one prefill iteration for a batch of prompt chunks; returns its number.

        The chunks run in one forward. For each chunk that ends its prompt, the token sampled
        at the last position goes the way every decode token goes: into the relay (with the
        seq len) for the next decode to resolve on the device, and into the host mirror for
        this iteration, read back by `read` like any decode iteration. Chunks that do not end
        their prompt write nothing there (their rows use padding slot 0). Chunks starting at
        position 0 admit their slot (a fresh generation). Never waits for the device.
        """
        if not 1 <= len(chunks) <= self.max_batch:
            raise ValueError(f"a prefill iteration takes 1..{self.max_batch} chunks (max_batch), got {len(chunks)}")
        self._require_engine_stream("prefill")
        self._command(PrefillCommand(list(chunks)))
        fresh = [c.slot for c in chunks if c.start == 0]
        if fresh:
            self.relay.admit(fresh)
        if self.history is not None:  # the drafter looks prompts up on the device
            for c in chunks:
                self.history.write_prompt(c.slot, torch.tensor(c.tokens), start=c.start)
        logits = self.model.prefill([c.slot for c in chunks], [c.tokens for c in chunks], [c.start for c in chunks])
        ends = [c.start + len(c.tokens) for c in chunks]
        # [5, B] int64: output slot (0 = nothing to report), top_k, seed, sampling step, seq len.
        # A prompt's last token sits at position end - 1: that is its sampling step, and the
        # decode steps that follow use the next positions.
        host = torch.tensor([
            [c.slot if c.last else 0 for c in chunks],
            [c.params.top_k for c in chunks],
            [c.params.seed for c in chunks],
            [end - 1 for end in ends],
            ends,
        ], dtype=torch.int64)
        params = torch.tensor([[c.params.temperature for c in chunks], [c.params.top_p for c in chunks]])
        dev, dev_params = to_device_async(host, self.device), to_device_async(params, self.device)
        slots = dev[0]
        raw_logits = logits
        if self.controls is not None:
            logits, row_states = self.controls.before_sample(logits, slots, dev[3])
        tokens = sample(logits, dev_params[0], dev[1], dev[2], dev[3], top_p=dev_params[1], max_top_k=self.config.max_top_k)
        if self.controls is not None:
            self.controls.after_sample(slots, raw_logits, tokens, row_states)
        seq_lens = dev[4].to(self.relay.config.seq_len_torch_dtype)
        payload, accept_len = RelayPayload(tokens=tokens), None
        if self.config.spec is not None:  # a speculative relay carries the accepted run: here one token
            accept_len = torch.ones_like(slots)
            accepted = torch.nn.functional.pad(tokens[:, None], (0, self.config.spec.k))  # [B, k + 1]
            payload = RelayPayload(tokens=tokens, accepted_tokens=accepted, accept_len=accept_len)
        self.relay.stash_and_publish(slots, payload, seq_lens)
        self.mirror.write(slots, tokens, seq_lens, accept_len=accept_len)
        return self._recorded()

    def admit_controls(self, slot: int, params: Optional[ControlParams], stop_tokens: Sequence[int],
                       prompt: Sequence[int]) -> None:
        """Load a request's controls into `slot` before its first prefill chunk (async)."""
        self._require_engine_stream("admit_controls")
        self.controls.admit(slot, params, stop_tokens, prompt)

    def read_logprobs(self, read: MirrorRead) -> Optional[list[TokenLogprobs]]:
        """The logprobs of `read`'s rows (before `fresh()`), or None without them."""
        if self.controls is None or self.controls.logprobs is None:
            return None
        return self.controls.logprobs.read(read)

    def launch(self, batch: HostBatch) -> int:
        """Queue one decode iteration for `batch` (graph replay, or eager); returns its number."""
        self._require_engine_stream("launch")
        self._command(LaunchCommand(batch))
        n = len(batch.slots)
        bs = self.runner.bucket(n) or n  # chosen once: the inputs are padded to it and it runs
        self.inputs.load(batch, bs, self.torch_stream)
        self.runner.run(bs)
        return self._recorded()

    def _require_engine_stream(self, call: str) -> None:
        """Work queued on another stream would not be ordered with the relay and mirror."""
        if self.on_gpu and torch.cuda.current_stream(self.device).cuda_stream != self.stream.handle:
            raise RuntimeError(f"Engine.{call} runs on the engine's stream: call it inside `with engine.activate():`")

    def _command(self, command: Command) -> None:
        """Tensor parallel, rank 0: the other ranks run the same iteration on their shards."""
        if self.tp is not None and self.tp.leads:
            self.tp.send(command)

    def follow(self) -> Optional[int]:
        """Ranks > 0: run rank 0's prefill and decode iterations until it stops (`release`);
        returns the host syncs torch made meanwhile, or None when rank 0 failed. The same calls
        in the same order keep every rank's relay, cache and collectives in step."""
        if self.tp is None or self.tp.leads:
            raise RuntimeError("Engine.follow runs on tensor-parallel ranks > 0; rank 0 schedules")
        with self.activate(), HostSyncCounter(self.on_gpu) as syncs:
            while not isinstance(command := self.tp.receive(), StopCommand):
                if isinstance(command, PrefillCommand):
                    self.prefill(command.chunks)
                else:
                    self.launch(command.batch)
        return None if command.failed else syncs.count

    def release(self, failed: bool = False) -> None:
        """Rank 0: let the other ranks leave `follow` (call once; `failed` after an error)."""
        if self.tp is not None and self.tp.leads:
            self.tp.send(StopCommand(failed))

    def _recorded(self) -> int:
        """Number the iteration just queued and record its mirror event."""
        iteration = self.iterations_launched
        self.mirror.record(iteration, self.stream)
        self.iterations_launched += 1
        return iteration

    def read(self, iteration: int, block: bool) -> Optional[MirrorRead]:
        """Iteration `iteration`'s sampled tokens and seq lens (stale rows flagged)."""
        return self.mirror.wait(iteration) if block else self.mirror.poll(iteration)