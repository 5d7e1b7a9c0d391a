"""The engine: relay, model, host mirror, input surface and captured graphs, built once.

The engine owns the device side of serving and exposes what a scheduler needs, all
non-blocking: `launch` one iteration (a flat batch of query spans: prefill chunks, decode rows
and, when speculating, verify spans) whose sampled tokens come back through `read` (poll or
wait) of the host mirror. Everything is ordered on one stream the engine creates with
cuda-python.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional, Sequence

import msgspec

import torch

from graphrelay.capture.iteration.buckets import default_buckets
from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.iteration.controls.params import ControlParams
from graphrelay.capture.iteration.controls.state import ControlsConfig, SamplingControls
from graphrelay.capture.iteration.graph_runner import CaptureReport, GraphRunner
from graphrelay.capture.iteration.inputs import IterationInputs, bucket_spans
from graphrelay.capture.iteration.ngram import SpecConfig, TokenHistory
from graphrelay.capture.iteration.spans import Span
from graphrelay.capture.iteration.step import CONTROLS, PLAIN, IterationStep
from graphrelay.capture.model.kv_cache import KV_CACHE_DTYPES
from graphrelay.capture.model.linear_plan import SKINNY_ROWS, LinearPlan
from graphrelay.capture.model.memory_plan import MemoryPlan, check_fits, plan_memory
from graphrelay.capture.model.model import LlamaModel, ModelConfig, ModelWeights
from graphrelay.capture.model.plan_file import load_or_measure
from graphrelay.capture.parallel.tensor_parallel import Command, LaunchCommand, StopCommand, TensorParallel
from graphrelay.capture.serving.sync_count import HostSyncCounter
from graphrelay import FieldSpec, Relay, RelayConfig
from graphrelay.mirror import HostMirror, MirrorRead
from graphrelay.runtime import Stream


# An iteration pays ~1 ms of fixed cost on the H200 (its node count) whatever its size, so a
# larger budget prefills faster (64 x 128 prompt tokens: 8.2 ms in four 2048-token iterations)
# at the price of a longer iteration beside running decodes; the peers' defaults are 8192.
DEFAULT_MAX_TOKENS = 4096


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything an `Engine` is sized by, validated where it is built.

    max_batch: the most requests (spans) one iteration carries. max_tokens: the most tokens
    one iteration carries (prefill chunks + decode rows + verify spans), the largest token
    bucket. use_graphs: capture one CUDA graph per token bucket (GPU only); otherwise the step
    runs eagerly on the same padded buckets, so both modes see identical shapes. buckets: the
    token counts captured (default: dense small, coarser large, up to max_tokens).
    """

    model: ModelConfig
    max_reqs: int
    max_batch: int
    device: str = "cpu"
    use_graphs: bool = True
    buckets: Optional[tuple[int, ...]] = None
    max_top_k: Optional[int] = 64
    mirror_depth: int = 3
    max_tokens: int = DEFAULT_MAX_TOKENS
    spec: Optional[SpecConfig] = None
    debug: bool = False
    controls: Optional[ControlsConfig] = None  # None: no sampling controls in the graphs
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8 e4m3 (capture.model.kv_cache)

    def __post_init__(self) -> None:
        for name in ("max_reqs", "max_batch", "mirror_depth", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_top_k is not None and (not isinstance(self.max_top_k, int) or isinstance(self.max_top_k, bool)
                                           or self.max_top_k < 1):
            raise ValueError(f"EngineConfig.max_top_k must be None or a positive int, got {self.max_top_k!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype {self.kv_cache_dtype!r} is not supported; use one of "
                             f"{sorted(KV_CACHE_DTYPES)} (auto: the model's dtype)")
        if self.buckets is not None and (not self.buckets or max(self.buckets) != self.max_tokens):
            raise ValueError(f"EngineConfig.buckets must end at max_tokens ({self.max_tokens}), the largest "
                             f"iteration the scheduler builds; got {self.buckets!r}")
        if self.max_tokens < self.decode_tokens:
            raise ValueError(
                f"EngineConfig.max_tokens ({self.max_tokens}) must hold a full decode iteration: max_batch "
                f"({self.max_batch}) x {self.tokens_per_decode} token(s) per request = {self.decode_tokens}; "
                f"raise max_tokens or lower max_batch"
            )

    @property
    def tokens_per_decode(self) -> int:
        """Tokens of one decode span: k + 1 when it verifies drafts, else 1."""
        return self.spec.rows if self.spec else 1

    @property
    def decode_tokens(self) -> int:
        """Tokens of the largest decode-only iteration."""
        return self.max_batch * self.tokens_per_decode

    def memory_plan(self, world: int = 1) -> MemoryPlan:
        """The memory one of `world` tensor-parallel ranks of this engine takes (its shard of
        the model); raises if the model does not split over `world`."""
        rows = bucket_spans(self.max_tokens, self.max_batch) * self.tokens_per_decode
        return plan_memory(self.model.shard(world), self.max_reqs, self.max_tokens, rows, self.kv_cache_dtype)


class Engine:
    """Everything one iteration touches, allocated up front from one `EngineConfig`: relay,
    model, host mirror, input surface, step and graph runner. The CLI, the benchmarks, the
    tests and the lint targets all build through it.

    weights: the model's real weights, whole (None: seeded random ones). progress: print
    capture progress. tp: this process's rank in a tensor-parallel group: every rank builds
    the same engine over its shard of the model; rank 0's `launch` also sends the spans to the
    others, which run them from `follow` (see `capture.parallel.tensor_parallel`).
    """

    def __init__(self, config: EngineConfig, *, weights: Optional[ModelWeights] = None, progress: bool = False,
                 tp: Optional[TensorParallel] = None):
        self.config = config
        self.tp = tp
        model_config, max_reqs, spec = config.model, config.max_reqs, config.spec
        self.device = torch.device(config.device)
        self.on_gpu = self.device.type == "cuda"
        per = config.tokens_per_decode
        self.inputs = IterationInputs(config.max_tokens, config.max_batch, per, self.device)
        # One mirror row per sampled row: the relay's max_batch sizes the mirror.
        rows = self.inputs.geometry(config.max_tokens).rows
        check_fits(config.memory_plan(tp.world if tp else 1), self.device)
        extra = {}
        if spec is not None:
            extra = dict(accepted_tokens=FieldSpec((spec.rows,), "int32"), accept_len=FieldSpec((), "int32"))
        self.relay = Relay(RelayConfig.plain(max_reqs, rows, debug=config.debug, **extra), self.device, validate=False)
        buckets = list(config.buckets) if config.buckets else default_buckets(config.max_tokens)
        self.model = LlamaModel(model_config, max_reqs, self.device, weights=weights, tp=tp,
                                attention_buckets=[(b, self.inputs.geometry(b).spans) for b in buckets],
                                kv_cache_dtype=config.kv_cache_dtype)
        self.mirror = HostMirror(self.relay, depth=config.mirror_depth, validate=False)
        self.history = TokenHistory(max_reqs, model_config.max_seq_len, self.device) if spec else None
        self.controls = None
        if config.controls is not None:
            if tp is not None:
                raise ValueError("EngineConfig.controls are not wired through tensor parallelism yet; drop --tp or the controls")
            self.controls = SamplingControls(config.controls, max_reqs, model_config.vocab_size, rows, self.device,
                                             mirror_depth=config.mirror_depth)
        self.step = IterationStep(self.relay, self.model, self.mirror, self.inputs, spec=spec, history=self.history,
                                  max_top_k=config.max_top_k, controls=self.controls)
        # With controls, every bucket is captured plain and controlled: `launch` picks per iteration.
        self.runner = GraphRunner(
            self.step, buckets, config.max_tokens, self.device, variants=self.step.variants,
            use_graphs=config.use_graphs, strict=True, progress=progress and (tp is None or tp.leads),
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
        # Per mirror ring slot, whether the iteration it holds ran the controls variant (only
        # those wrote logprobs); an iteration is readable only while it is in the ring.
        self._controlled = [False] * config.mirror_depth
        # Per slot, an upper bound on its tokens in the cache after the iterations launched so
        # far (a decode span adds k + 1 whatever is accepted): eager steps attend only that far.
        self._length_bound = [0] * (max_reqs + 1)
        if self.on_gpu:
            # The engine stream does not order against the legacy default stream that built
            # the weights: finish construction before any work is queued on it.
            torch.cuda.synchronize(self.device)

    @property
    def max_batch(self) -> int:
        """The most requests one iteration runs."""
        return self.config.max_batch

    @property
    def max_tokens(self) -> int:
        """The most tokens one iteration runs (the largest token bucket)."""
        return self.config.max_tokens

    @property
    def uses_graphs(self) -> bool:
        """Whether iterations replay captured graphs (after `capture`, on a GPU, with graphs on)."""
        return bool(self.runner.graphs)

    @property
    def max_reqs(self) -> int:
        return self.relay.config.max_reqs

    def activate(self):
        """Context manager making the engine stream current for torch work (GPU), or a no-op.
        `launch` refuses to run outside it."""
        return torch.cuda.stream(self.torch_stream) if self.on_gpu else nullcontext()

    def capture(self, plan: LinearPlan | None = None, plan_file: Path | None = None) -> CaptureReport:
        """Warm up and capture every token bucket, then restart the mirror at iteration 0.
        plan: the projection backends to use; None measures them on this GPU (twins that must
        agree bit for bit share one plan, since timings choose by noise where backends tie).
        plan_file: read the plan from this file, or measure and write it there when it does
        not exist (`plan_file`: another process of this shape then launches the same kernels)."""
        if plan is not None and plan_file is not None:
            raise ValueError("Engine.capture takes a plan or a plan_file, not both")
        with self.activate():
            if plan is None:
                # Projection backends per token bucket, timed on this GPU before anything is
                # captured (only where a skinny GEMM can win; larger buckets keep cuBLAS).
                small = [b for b in self.runner.buckets if b <= SKINNY_ROWS]
                plan = (LinearPlan.measured(self.model, small, stream=self.torch_stream) if plan_file is None
                        else load_or_measure(plan_file, self.model, small, stream=self.torch_stream))
            self.model.plan = plan
            report = self.runner.capture()
        self.mirror.reset()
        if self.controls is not None and self.controls.logprobs is not None:
            self.controls.logprobs.reset()
        self.iterations_launched = 0
        return report

    def span_tokens(self, span: Span) -> int:
        """Tokens `span` takes in an iteration: its chunk, or one decode (or verify) span."""
        return len(span.tokens) if span.tokens else self.config.tokens_per_decode

    def check_spans(self, spans: Sequence[Span]) -> int:
        """Reject an iteration the engine cannot run, before anything is queued; returns its
        token count. Host-only checks of what the scheduler built (no device reads)."""
        c = self.model.config
        if not 1 <= len(spans) <= self.max_batch:
            raise ValueError(f"an iteration takes 1..{self.max_batch} spans (max_batch), got {len(spans)}")
        slots = [s.slot for s in spans]
        if len(set(slots)) != len(slots):
            raise ValueError("an iteration holds at most one span per slot")
        # The common case in C loops (type, min, max: this runs every iteration, ~100 µs at 256
        # spans as a Python loop); the first bad slot named when it fails.
        if not set(map(type, slots)) <= {int, bool} or min(slots) < 1 or max(slots) > self.max_reqs:
            bad = next(x for x in slots if not isinstance(x, int) or not 1 <= x <= self.max_reqs)
            raise ValueError(f"span slot must be an int in 1..{self.max_reqs} (0 is padding), got {bad!r}")
        chunks = [span for span in spans if span.tokens]
        for span in chunks:
            if not 0 <= span.start <= c.max_seq_len - len(span.tokens):
                raise ValueError(f"prompt chunk for slot {span.slot}: start {span.start} + length "
                                 f"{len(span.tokens)} exceeds max_seq_len {c.max_seq_len}")
        tokens = sum(len(span.tokens) for span in chunks) + (len(spans) - len(chunks)) * self.config.tokens_per_decode
        if tokens > self.max_tokens:
            raise ValueError(f"an iteration of {tokens} tokens exceeds max_tokens {self.max_tokens}; "
                             f"schedule fewer prompt tokens per iteration")
        return tokens

    def launch(self, spans: Sequence[Span], before_replay: Optional[Callable[[], None]] = None) -> int:
        """Queue one iteration of `spans` (graph replay of the smallest token bucket that fits,
        or eager); returns its number. Spans starting a prompt at position 0 admit their slot
        (a fresh generation). Never waits for the device. `before_replay`: called once the
        inputs' copy is queued, just before the step itself (the serving loop records a timing
        event there, so that the GPU's wait for this host work is not counted as step time)."""
        self._require_engine_stream("launch")
        tokens = self.check_spans(spans)
        spans = list(spans)
        self._command(LaunchCommand(spans))
        fresh = [s.slot for s in spans if s.tokens and s.start == 0]
        if fresh:
            self.relay.admit(fresh)
        bucket = self.runner.bucket(tokens)  # chosen once: the inputs are laid out for it and it runs
        self.step.key_bound = None if self.uses_graphs else self._key_bound(spans)
        self.inputs.load(spans, bucket, self.config.tokens_per_decode, self.torch_stream)
        variant = self.variant(spans)
        if before_replay is not None:
            before_replay()
        self.runner.run(bucket, variant)
        self._controlled[self.iterations_launched % self.config.mirror_depth] = variant == CONTROLS
        return self._recorded()

    def variant(self, spans: Sequence[Span]) -> str:
        """The step variant an iteration of `spans` runs: "controls" when any of their slots
        was admitted with controls in use (the whole batch then runs them; the neutral rows
        come out as in "plain"), else "plain". Decided from host-side flags: no device read."""
        if self.controls is not None and self.controls.in_use([s.slot for s in spans]):
            return CONTROLS
        return PLAIN

    def _key_bound(self, spans: Sequence[Span]) -> int:
        """The most keys any token of `spans` attends, rounded up to 64 so eager shapes repeat."""
        bound = self._length_bound
        for span in spans:
            bound[span.slot] = span.start + len(span.tokens) if span.tokens else bound[span.slot] + self.span_tokens(span)
        longest = max(bound[s.slot] for s in spans) + 1  # a decode span's last token sits at the bound
        return min(self.model.config.max_seq_len, -(-longest // 64) * 64)

    def admit_controls(self, slot: int, params: Optional[ControlParams], stop_tokens: Sequence[int],
                       prompt: Sequence[int]) -> None:
        """Load a request's controls into `slot` before its first prompt chunk (async)."""
        self._require_engine_stream("admit_controls")
        self.controls.admit(slot, params, stop_tokens, prompt)

    def read_logprobs(self, read: MirrorRead) -> Optional[list[Optional[TokenLogprobs]]]:
        """The logprobs of `read`'s rows (before `fresh()`; None for a row whose request did not
        ask: not computed), or None without them: an engine without logprobs, or an iteration
        that ran plain (no request in it asked)."""
        if self.controls is None or self.controls.logprobs is None:
            return None
        if not self._controlled[read.iteration % self.config.mirror_depth]:
            return None
        return self.controls.logprobs.read(read)

    def _require_engine_stream(self, call: str) -> None:
        """Work queued on another stream would not be ordered with the relay and mirror."""
        if self.on_gpu and torch.cuda.current_stream(self.device).cuda_stream != self.stream.handle:
            raise RuntimeError(f"Engine.{call} runs on the engine's stream: call it inside `with engine.activate():`")

    def _command(self, command: Command) -> None:
        """Tensor parallel, rank 0: the other ranks run the same iteration on their shards."""
        if self.tp is not None and self.tp.leads:
            self.tp.send(command)

    def follow(self) -> Optional[int]:
        """Ranks > 0: run rank 0's iterations until it stops (`release`); returns the host
        syncs torch made meanwhile, or None when rank 0 failed. The same calls in the same
        order keep every rank's relay, cache and collectives in step."""
        if self.tp is None or self.tp.leads:
            raise RuntimeError("Engine.follow runs on tensor-parallel ranks > 0; rank 0 schedules")
        with self.activate(), HostSyncCounter(self.on_gpu) as syncs:
            while not isinstance(command := self.tp.receive(), StopCommand):
                self.launch(command.spans)
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
