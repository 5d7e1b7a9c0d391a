"""Which backend runs each projection of the layer stack, per row count: chosen by measurement.

Per projection there are two ways to run it (`capture.kernels.gemv`):
- "torch": today's unfused nodes, a cuBLAS GEMM between layer_kernels' norm and SiLU*up;
  an O / down projection leaves its output pending and the next norm adds it in.
- "triton": one fused skinny-GEMM node (norm + QKV + rotary + K/V append, O + residual add,
  norm + gate/up + SiLU*up, down + residual add), launched with programmatic dependent launch
  where the GPU has it.
Which wins depends on the row count (a GEMV at 1 row, a real GEMM at 256) and on the GPU,
so `LinearPlan.measured` times both inside small CUDA graphs at start-up, before the step is
captured, and keeps the faster per (row count, projection). "triton" is timed in a few tilings
(`candidate_tiles`) and the fastest is kept with it. On a CPU, and under tensor parallelism
(the residual add must follow the all-reduce), it is torch throughout.

The layer stack threads the residual `stream` and a pending `update` (None once added):

    ops = plan.ops(rows, eps, reduce)
    update, stream = None, embeddings
    for layer in layers:
        q, stream = ops.qkv(update, stream, layer, rotary)   # rotary: that layer's gemv.Rotary
        update, stream = ops.o(attention(q), stream, layer)
        act, stream = ops.gate_up(update, stream, layer)
        update, stream = ops.down(act, stream, layer)
    hidden = ops.final_norm(update, stream, final_norm)  # or final_norm(..., rows): those rows only

Every combination of backends computes the same values as the all-torch stack up to the
order of float32 sums; all-torch is op for op what the model ran before the plan existed.
"""

from __future__ import annotations

import bisect
import math
import warnings
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import msgspec
import torch
import triton

from graphrelay.capture.kernels import gemv
from graphrelay.capture.kernels.gemv_tiles import FMA_MAX_K, SplitKWorkspace, Tiles, check_tiles, pipeline_bytes
from graphrelay.capture.kernels import layer_kernels as kernels

if TYPE_CHECKING:
    from graphrelay.capture.model.model import LayerWeights, LlamaModel

PROJECTIONS = ("qkv", "o", "gate_up", "down")
BACKENDS = ("torch", "triton")
# Engines time the row counts up to this (their buckets this small); above, a 64-row tile
# re-reads the weights often enough that cuBLAS wins every projection (at 256 rows Triton still
# wins the O projection on the H200).
SKINNY_ROWS = 256
SPLIT_PROJECTIONS = ("o", "down")  # the projections split-K tilings serve (gemv.linear_residual)
CHAIN = 16  # calls per timed graph: one replay's host cost (~5 us) spread thin
REPLAYS = 5  # timed replays; the median graph counts
# A candidate tiling must compute what the unfused path does before it is timed: within this
# much of the output's largest magnitude. Another float32 sum order moves a 16-bit output by an
# ulp or two (2**-8 of it), a tiling the compiler got wrong by the output's own size.
AGREEMENT = 2.0**-5


class ProjectionTiming(msgspec.Struct, frozen=True):
    """GPU microseconds per call of one projection at one row count, each backend; triton_us
    is its fastest tiling's, `tiles` (None: the kernel's default tiling)."""

    rows: int
    projection: str
    torch_us: float
    triton_us: float
    tiles: Tiles | None = None

    @property
    def faster(self) -> str:
        return "triton" if self.triton_us < self.torch_us else "torch"


class LayerOps:
    """One row count's projection entry points (see the module docstring for the chain)."""

    def __init__(self, backends: Mapping[str, str], eps: float, reduce: Callable[[torch.Tensor], torch.Tensor],
                 pdl: bool | None, tiles: Mapping[str, Tiles] | None = None,
                 workspace: SplitKWorkspace | None = None):
        self.backends, self.eps, self.reduce, self.pdl = dict(backends), eps, reduce, pdl
        self.tiles = dict(tiles or {})  # projection -> Triton tiling; missing: the default
        self.workspace = workspace  # a split-K tiling's scratch (the model's, allocated up front)

    def qkv(self, update, stream, layer: "LayerWeights", rotary: gemv.Rotary):
        """-> (rotated q `[n, h, d]`, stream with `update` added); appends k and v to the
        caches in `rotary`."""
        return self._norm_projection(gemv.norm_qkv_rotary, "qkv", update, stream, layer.attn_norm, layer.qkv,
                                     rotary)

    def o(self, attn, stream, layer: "LayerWeights"):
        """-> (pending update or None, stream)."""
        return self._projection("o", attn, layer.o, stream)

    def gate_up(self, update, stream, layer: "LayerWeights"):
        """-> (silu(gate) * up `[n, inter]`, stream with `update` added)."""
        return self._norm_projection(gemv.norm_gate_up_silu, "gate_up", update, stream, layer.mlp_norm,
                                     layer.gate_up)

    def down(self, act, stream, layer: "LayerWeights"):
        """-> (pending update or None, stream)."""
        return self._projection("down", act, layer.down, stream)

    def final_norm(self, update, stream, weight: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The last norm, of every row or (rows) of those rows alone, gathered in the same node."""
        if update is None:
            return kernels.rms_norm(stream, weight, self.eps, rows=rows)
        if rows is not None:
            return kernels.rms_norm(update, weight, self.eps, residual=stream, rows=rows)
        return kernels.rms_norm(update, weight, self.eps, residual=stream)[0]

    def _norm_projection(self, fused, projection, update, stream, norm_weight, weight, *extra):
        options = dict(backend=self.backends[projection], pdl=self.pdl, tiles=self.tiles.get(projection))
        if update is None:
            return fused(stream, norm_weight, weight, self.eps, *extra, **options), stream
        return fused(update, norm_weight, weight, self.eps, *extra, residual=stream, **options)

    def _projection(self, projection, x, weight, stream):
        if self.backends[projection] == "torch":
            # Left pending: the next norm adds it in its own node (layer_kernels.rms_norm).
            return self.reduce(x @ weight.T), stream
        return None, gemv.linear_residual(x, weight, stream, out=stream, backend="triton", pdl=self.pdl,
                                          tiles=self.tiles.get(projection), workspace=self.workspace)


_MEASURED: dict[tuple, "LinearPlan"] = {}  # LinearPlan.measured's, per shape and row counts


class LinearPlan:
    """Backend per projection for each measured row count.

    choices: row count -> projection -> backend. A call with `rows` rows uses the smallest
    measured row count >= rows (buckets pad up to it); beyond the largest, `default`.
    tiles: row count -> projection -> the tiling of a "triton" choice (missing: the default).
    pdl: passed to the Triton kernels (None: on where the GPU supports it).
    """

    def __init__(self, choices: Mapping[int, Mapping[str, str]] | None = None, *, default: str = "torch",
                 pdl: bool | None = None, tiles: Mapping[int, Mapping[str, Tiles]] | None = None):
        choices = dict(choices or {})
        for rows, backends in choices.items():
            if not isinstance(rows, int) or rows < 1:
                raise ValueError(f"LinearPlan row counts must be positive ints, got {rows!r}")
            if set(backends) != set(PROJECTIONS) or any(b not in BACKENDS for b in backends.values()):
                raise ValueError(f"LinearPlan choices for {rows} rows must map each of {PROJECTIONS} to one of "
                                 f"{BACKENDS}, got {dict(backends)}")
        if default not in BACKENDS:
            raise ValueError(f"LinearPlan default must be one of {BACKENDS}, got {default!r}")
        self.choices = {rows: dict(choices[rows]) for rows in sorted(choices)}
        self.tiles = {rows: dict(by_projection) for rows, by_projection in (tiles or {}).items()}
        for rows, by_projection in self.tiles.items():
            if rows not in self.choices or any(self.choices[rows].get(p) != "triton" for p in by_projection):
                raise ValueError(f"LinearPlan tiles for {rows} rows must name projections that row count runs on "
                                 f"triton, got {sorted(by_projection)} with choices {self.choices.get(rows)}")
            for projection, tiles in by_projection.items():
                if check_tiles(tiles).split_k > 1 and projection not in SPLIT_PROJECTIONS:
                    raise ValueError(f"LinearPlan tiles for {rows} rows: a split-K tiling serves only "
                                     f"{SPLIT_PROJECTIONS}, got {tiles} for {projection}")
        self.default, self.pdl = default, pdl
        self._sizes = list(self.choices)

    @classmethod
    def fixed(cls, backend: str, pdl: bool | None = None) -> "LinearPlan":
        """Every projection on `backend` at every row count (tests; the CPU)."""
        return cls(default=backend, pdl=pdl)

    @classmethod
    def from_timings(cls, timings: Sequence[ProjectionTiming], pdl: bool | None = None) -> "LinearPlan":
        choices: dict[int, dict[str, str]] = {}
        tiles: dict[int, dict[str, Tiles]] = {}
        for t in timings:
            choices.setdefault(t.rows, {})[t.projection] = t.faster
            if t.faster == "triton" and t.tiles is not None:
                tiles.setdefault(t.rows, {})[t.projection] = t.tiles
        return cls(choices, pdl=pdl, tiles=tiles)

    @classmethod
    def measured(cls, model: "LlamaModel", sizes: Sequence[int], *,
                 stream: torch.cuda.Stream | None = None) -> "LinearPlan":
        """Time both backends for every projection at each row count in `sizes` (CUDA graphs,
        on `stream`), keep the faster. Torch throughout on a CPU or under tensor parallelism.
        Run it before capturing: it compiles the kernels the chosen plan launches."""
        if model.device.type != "cuda" or model.tp is not None or not sizes:
            return cls.fixed("torch")  # no bucket small enough for a skinny GEMM to win: cuBLAS
        # Timings depend on shapes alone: a process that builds several engines of one shape
        # (tests, twins that must agree bit for bit) measures once.
        key = (model.device, *model_shape(model).values(), tuple(sorted(set(sizes))))
        if key not in _MEASURED:
            _MEASURED[key] = cls.from_timings(time_projections(model, sizes, stream=stream))
        return _MEASURED[key]

    def backends(self, rows: int) -> dict[str, str]:
        size = self._planned_size(rows)
        return dict.fromkeys(PROJECTIONS, self.default) if size is None else dict(self.choices[size])

    def tiles_for(self, rows: int) -> dict[str, Tiles]:
        """The tilings of the Triton projections at `rows` (missing: the default)."""
        size = self._planned_size(rows)
        return {} if size is None else dict(self.tiles.get(size, {}))

    def _planned_size(self, rows: int) -> int | None:
        at = bisect.bisect_left(self._sizes, rows)
        return None if at == len(self._sizes) else self._sizes[at]

    def ops(self, rows: int, eps: float, reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
            workspace: SplitKWorkspace | None = None) -> LayerOps:
        """The entry points for a forward of `rows` rows. reduce: applied to a pending
        (torch-path) O / down output, e.g. the tensor-parallel all-reduce. workspace: for
        split-K tilings (one is allocated per call without it)."""
        return LayerOps(self.backends(rows), eps, reduce, self.pdl, self.tiles_for(rows), workspace)


def model_shape(model: "LlamaModel") -> dict[str, int | str]:
    """What the timings depend on besides the GPU and the row counts: the (shard's) shapes."""
    c = model.shard
    return {"hidden_size": c.hidden_size, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "dtype": c.dtype,
            "layers": len(model.layers)}


# ----------------------------------------------------------------------------------------------
# Measurement


# Beyond 64 rows the tensor-core tilings keep 8 K steps in flight, not 4: in the captured step on
# the H100 decode at 256 rows took 1.3-3.4% less time (1.020 against 1.056 ms; 2.167 against 2.199
# over 512 keys), where the same depth at 64 rows cost 3-4% (results/deep_stages_h100.txt).
# Start-up's isolated timings did not show the gain, so the depth is set per regime here rather
# than offered to the timing, for the tilings whose buffers that deep fit the H100's and the
# H200's shared memory (227 KB a block); the others keep TC_STAGES.
DEEP_STAGES = 8
DEEP_SHARED_MEMORY_BYTES = 232448


def _deepened(tiles: Tiles, split: bool) -> Tiles:
    """`tiles` at DEEP_STAGES where that fits DEEP_SHARED_MEMORY_BYTES, else unchanged (split: O
    or down, no norm prologue: fewer buffers a K step)."""
    deep = tiles._replace(stages=DEEP_STAGES)
    return deep if pipeline_bytes(deep, norm=not split) <= DEEP_SHARED_MEMORY_BYTES else tiles


def shared_memory_bytes(device: torch.device) -> float:
    """The shared memory a block may have on `device` (what Triton checks a launch against);
    unbounded off CUDA, where no launch is compiled for a GPU."""
    if device.type != "cuda":
        return math.inf
    return triton.runtime.driver.active.utils.get_device_properties(device.index)["max_shared_mem"]


def tiles_fit(tiles: Tiles, projection: str, dtype: torch.dtype, shared_memory: float) -> bool:
    """Whether `projection` in `tiles` builds within `shared_memory`, with the residual the step
    may pass it (`gemv_tiles.pipeline_bytes`; a norm projection unless O or down)."""
    return pipeline_bytes(tiles, projection not in SPLIT_PROJECTIONS, dtype.itemsize) <= shared_memory


def candidate_tiles(rows: int, k: int, split: bool = False) -> list[Tiles]:
    """The Triton tilings start-up timing tries for a projection of `rows` rows and K = k
    (split: an O or down projection, which split-K tilings can serve).

    A few per regime, so start-up compiles few variants: the winners of sweeps on the H200
    (SmolLM2-135M's four projections, 30 layers' weights in one graph; 1-256 rows,
    results/tiles_sweep_h200.txt, then the pipelined tensor-core loop at 16 / 64 / 256 rows,
    results/skinny_stages_h200.txt). Up to 4 rows: one program per row pair or quad on the
    CUDA cores, the whole K in one step. 5-16: the same at 4 rows, or the smallest tensor-core
    tiles. Beyond: tensor-core tiles with short K steps (the pipeliner keeps `Tiles.stages` of
    them in flight), wider or taller with the row count; beyond 64 rows each also with its epilogue
    inputs requested before the K loop (`Tiles.early`: on the H100 6% faster at 256 decode rows,
    3% slower at 64).

    Added without a GPU, for the start-up timing to take or leave (on the H100 every one builds
    and passes the gate; results/tiles_sweep_h100.txt times those beyond 64 rows):
    from 5 to 64 rows, swapped tiles (`Tiles.swap`: 64 weight rows as the MMA's M side, so
    tiles of 16-64 x rows can use Hopper's warpgroup MMA, which the sweeps' 16-row tiles could
    not); beyond 64 rows the 64 x 64 tile; and for O and down from 5 rows, split-K tiles
    (`Tiles.split_k`: their 576 output columns make few tiles, down's K is 1,536 long, so an
    unsplit grid leaves most of the GPU idle)."""
    whole_k = min(triton.next_power_of_2(k), FMA_MAX_K)
    if rows <= 4:
        m = triton.next_power_of_2(rows)
        return [Tiles(m, 2, whole_k, 8, True), Tiles(m, 4, whole_k, 4, True)]
    swapped = Tiles(16, 64, 64, 4, False, swap=True)
    if rows <= 16:
        tiles = [Tiles(4, 2, whole_k, 8, True), Tiles(4, 4, whole_k, 4, True),
                 Tiles(16, 16, 64, 4, False), Tiles(16, 32, 64, 4, False), Tiles(16, 16, 128, 4, False),
                 swapped]
        splits = [Tiles(16, 16, 128, 4, False, split_k=2)]
    elif rows <= 64:
        tiles = [Tiles(16, 32, 64, 4, False), Tiles(16, 64, 64, 4, False), Tiles(64, 16, 128, 4, False),
                 swapped, swapped._replace(block_m=64)]
        splits = [Tiles(16, 32, 64, 4, False, split_k=2), Tiles(64, 16, 128, 4, False, split_k=2),
                  Tiles(64, 16, 128, 4, False, split_k=4)]
    else:
        plain = [Tiles(16, 64, 64, 8, False), Tiles(64, 32, 64, 4, False), Tiles(64, 32, 128, 4, False),
                 Tiles(64, 64, 64, 4, False)]
        # 64 x 64 in 8 warps: gate/up's fastest Triton tiling at 256 rows on the H100
        # (results/tiles_sweep_h100.txt), 7% ahead of 4 warps.
        tiles = plain + [t._replace(early=True) for t in plain] + [Tiles(64, 64, 64, 8, False)]
        splits = [Tiles(64, 32, 128, 4, False, split_k=2), Tiles(64, 32, 128, 4, False, split_k=4)]
        tiles = [_deepened(t, split) for t in tiles]
        splits = [_deepened(t, True) for t in splits]
    return tiles + splits if split else tiles


def time_projections(model: "LlamaModel", sizes: Sequence[int], *, stream: torch.cuda.Stream | None = None,
                     pdl: bool | None = None) -> list[ProjectionTiming]:
    """GPU µs per call of each projection on each backend (Triton: each `candidate_tiles`
    tiling, the fastest kept) at each row count. A timed chain walks the model's layers, so
    weights come from memory as in the step rather than hot in L2. Each backend runs the form
    a chain of its own calls takes: torch with a pending update to add (its add + norm node),
    Triton without. The QKV projection includes the rotary and K/V append, into padding slot
    0's cache rows. A tiling that fails to compile on this GPU, or whose output disagrees with
    the unfused path's (`AGREEMENT`), is not a choice: skipped with a warning naming it. So is one
    whose buffers exceed this GPU's shared memory (`tiles_fit`), silently: it is timed without a
    residual, which the step may pass it, and it must build with one too."""
    if model.device.type != "cuda":
        raise ValueError(f"time_projections needs a CUDA model, got one on {model.device}")
    bad = [s for s in sizes if not isinstance(s, int) or s < 1]
    if not sizes or bad:
        raise ValueError(f"time_projections sizes must be positive ints, got {list(sizes)}")
    c, layers = model.shard, model.layers
    stream = stream or torch.cuda.Stream(model.device)  # capturing needs a stream other than the legacy default
    timings = []
    # Zeroed before each timed replay, so the weights come from memory, not L2, as in the step.
    flush = torch.empty(torch.cuda.get_device_properties(model.device).L2_cache_size, dtype=torch.uint8,
                        device=model.device)
    workspace = SplitKWorkspace(max(sizes), c.hidden_size, model.device)
    shared_memory = shared_memory_bytes(model.device)
    with torch.cuda.stream(stream), torch.no_grad():
        for rows in sorted(set(sizes)):
            gen = torch.Generator(device=model.device).manual_seed(rows)

            def rand(width: int) -> torch.Tensor:
                return torch.randn(rows, width, generator=gen, device=model.device).to(c.torch_dtype)

            stream_x, update = rand(c.hidden_size), rand(c.hidden_size)
            gate_stream = stream_x.clone()
            attn, act = rand(c.num_heads * c.head_dim), rand(c.intermediate_size)
            positions = torch.arange(rows, device=model.device) % c.max_seq_len
            rotary = gemv.Rotary(model.rope_cos, model.rope_sin, positions, torch.zeros_like(positions),
                                 model.kv_cache.keys[0], model.kv_cache.values[0], c.num_heads, c.num_kv_heads)
            for projection in PROJECTIONS:
                k = {"o": c.num_heads * c.head_dim, "down": c.intermediate_size}.get(projection, c.hidden_size)
                tilings = candidate_tiles(rows, k, split=projection in SPLIT_PROJECTIONS)
                variants = [("torch", None)] + [("triton", t) for t in tilings]
                # The gate's own copy of the stream: the timed O / down calls update stream_x in place.
                inputs = (gate_stream, attn, act, rotary, c.rms_eps, workspace, pdl)
                reference = _projection_output(projection, None, layers[0], *inputs)
                times = []

                def usable(tiles: Tiles) -> bool:
                    return (tiles_fit(tiles, projection, c.torch_dtype, shared_memory)
                            and _tiling_works(projection, rows, tiles, reference, layers[0], inputs))

                for backend, tiles in variants:
                    if tiles is not None and not usable(tiles):
                        times.append(math.inf)
                        continue
                    ops = LayerOps(dict.fromkeys(PROJECTIONS, backend), c.rms_eps, lambda t: t, pdl,
                                   dict.fromkeys(PROJECTIONS, tiles) if tiles else None, workspace)
                    pending = update if backend == "torch" else None
                    call = {
                        "qkv": lambda layer: ops.qkv(pending, stream_x, layer, rotary),
                        "o": lambda layer: ops.o(attn, stream_x, layer),
                        "gate_up": lambda layer: ops.gate_up(pending, stream_x, layer),
                        "down": lambda layer: ops.down(act, stream_x, layer),
                    }[projection]
                    times.append(_graph_us(call, layers, stream, flush))
                best = min(range(1, len(variants)), key=times.__getitem__)
                timings.append(ProjectionTiming(rows, projection, times[0], times[best], variants[best][1]))
    return timings


def _projection_output(projection: str, tiles: Tiles | None, layer: "LayerWeights", x, attn, act, rotary,
                       eps: float, workspace: SplitKWorkspace, pdl: bool | None) -> torch.Tensor:
    """One projection's fused output on the same inputs for either path: the unfused torch
    path (tiles None) or the Triton kernel in `tiles`; O and down out of place."""
    options = dict(backend="torch") if tiles is None else dict(backend="triton", tiles=tiles, pdl=pdl)
    if projection == "qkv":
        return gemv.norm_qkv_rotary(x, layer.attn_norm, layer.qkv, eps, rotary, **options)
    if projection == "gate_up":
        return gemv.norm_gate_up_silu(x, layer.mlp_norm, layer.gate_up, eps, **options)
    activation, weight = (attn, layer.o) if projection == "o" else (act, layer.down)
    return gemv.linear_residual(activation, weight, x, **options, **({} if tiles is None else {"workspace": workspace}))


def _tiling_works(projection: str, rows: int, tiles: Tiles, reference: torch.Tensor,
                  layer: "LayerWeights", inputs: tuple) -> bool:
    """Whether `tiles` builds on this GPU and agrees with the unfused output; warns when not
    (a tile too big for the GPU's shared memory is simply not a choice)."""
    try:
        got = _projection_output(projection, tiles, layer, *inputs)
    except triton.runtime.errors.OutOfResources:
        return False
    except (triton.compiler.errors.CompilationError, RuntimeError) as exc:
        warnings.warn(f"start-up timing skips {tiles} for the {projection} projection at {rows} rows: it does not "
                      f"build on this GPU ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        return False
    error = float((got.float() - reference.float()).abs().max())
    if not error <= AGREEMENT * float(reference.float().abs().max()):  # NaN fails too
        warnings.warn(f"start-up timing skips {tiles} for the {projection} projection at {rows} rows: its output "
                      f"is {error:.3g} away from the unfused path's, not a float32 rounding difference")
        return False
    return True


def _graph_us(call: Callable[["LayerWeights"], object], layers: Sequence["LayerWeights"],
              stream: torch.cuda.Stream, flush: torch.Tensor) -> float:
    """Median GPU µs per call over CHAIN calls (on successive layers' weights) captured in one
    graph, replayed REPLAYS times, each after `flush` is zeroed (it evicts L2)."""
    call(layers[0])  # compiles Triton kernels and settles cuBLAS' workspace outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(CHAIN):
            call(layers[i % len(layers)])
    graph.replay()  # the first launch uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(REPLAYS):
        flush.zero_()
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CHAIN)
    return sorted(samples)[len(samples) // 2]
