"""Capture a step function once per bucket, replay the smallest bucket that fits a batch.

The step is `step(bs)`, or `step(bs, variant)` for a step captured in several variants (the
engine's plain and controlled iterations): it reads and writes `[:bs]` views of static buffers
and nothing else (no host syncs, no data-dependent shapes). Capture follows what works in
production engines: warm each bucket (and variant) up on a side stream (Triton kernels compile
on their first call; cuBLAS picks its workspaces), then capture largest first so every smaller
graph fits in the memory the larger ones already took from the one shared pool.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Callable, Optional, Sequence

import msgspec
import torch

from graphrelay.capture.iteration.buckets import bucket_for, check_buckets
from graphrelay.runtime import graph_node_count

WARMUP_RUNS = 2


class CaptureReport(msgspec.Struct):
    buckets: list[int]
    seconds: float  # warm-up + capture, all buckets
    graph_memory_bytes: int  # device memory the shared pool reserved for the graphs
    nodes: dict[int, int] = {}  # bucket -> node count of its (last variant's) captured graph, read from the graph
    variant_nodes: dict[str, dict[int, int]] = {}  # variant -> bucket -> node count (named variants only)


class GraphRunner:
    """One CUDA graph per bucket and variant for `step`, all in one memory pool.

    variants: the names `step` takes as its second argument, one graph each per bucket; empty:
    `step(bs)`, one graph per bucket. The last variant is captured first in each bucket (the
    fullest, so the others fit in the memory it took) and is the one `nodes` reports.

    On a CPU device (or with `use_graphs=False`) nothing is captured and `run` calls the step
    eagerly on the same padded bucket, so eager and graph modes see identical shapes.
    A batch larger than the largest bucket runs eagerly at its own size with a one-time
    warning, or raises when `strict`.
    """

    def __init__(
        self,
        step: Callable[[int], None],
        buckets: Sequence[int],
        max_batch: int,
        device: torch.device | str,
        *,
        variants: Sequence[str] = (),
        use_graphs: bool = True,
        strict: bool = False,
        sync_debug: bool = True,
        progress: bool = False,
        capture_error_mode: str = "global",
    ):
        self.step = step
        self.buckets = check_buckets(buckets, max_batch)
        self.max_batch = max_batch
        self.variants: tuple[Optional[str], ...] = tuple(variants) or (None,)
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.strict = strict
        self.sync_debug = sync_debug
        self.progress = progress
        self.capture_error_mode = capture_error_mode
        self.graphs: dict[int, dict[Optional[str], torch.cuda.CUDAGraph]] = {}  # bucket -> variant -> graph
        self.report: Optional[CaptureReport] = None
        self._warned = False

    def capture(self) -> CaptureReport:
        """Warm up and capture every bucket and variant (no-op without graphs). Call outside any capture."""
        start = time.perf_counter()
        if not self.use_graphs:
            self.report = CaptureReport(self.buckets, 0.0, 0)
            return self.report
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        order = sorted(self.buckets, reverse=True)
        variants = self.variants[::-1]
        # Every bucket and variant is warmed up before any capture, so warm-up's own allocations
        # (cached by the allocator afterwards) are not counted as graph memory: the figure is the pool's.
        for bs in order:
            for variant in variants:
                self._warm_up(bs, variant, side)
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        nodes: dict[Optional[str], dict[int, int]] = {variant: {} for variant in variants}
        for n, bs in enumerate(order, 1):
            if self.progress:
                print(f"\rcapturing CUDA graphs: bucket {bs:4d} ({n}/{len(order)})", end="", file=sys.stderr, flush=True)
            for variant in variants:
                # keep_graph: the captured cudaGraph_t stays readable, so its nodes can be counted.
                graph = torch.cuda.CUDAGraph(keep_graph=True)
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode=self.capture_error_mode):
                    self._step(bs, variant)
                graph.instantiate()
                nodes[variant][bs] = graph_node_count(graph.raw_cuda_graph())
                self.graphs.setdefault(bs, {})[variant] = graph
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        named = {variant: by_bucket for variant, by_bucket in nodes.items() if variant is not None}
        self.report = CaptureReport(self.buckets, seconds, torch.cuda.memory_reserved(self.device) - reserved_before,
                                    nodes[self.variants[-1]], named)
        if self.progress:
            print(f"\rcaptured {len(order) * len(variants)} CUDA graphs in {seconds:.1f} s, "
                  f"{self.report.graph_memory_bytes / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        return self.report

    def _step(self, bs: int, variant: Optional[str]) -> None:
        if variant is None:
            self.step(bs)
        else:
            self.step(bs, variant)

    def _warm_up(self, bs: int, variant: Optional[str], side: torch.cuda.Stream) -> None:
        side.wait_stream(torch.cuda.current_stream(self.device))
        previous = torch.cuda.get_sync_debug_mode()
        if self.sync_debug:
            # Any host sync in the step raises here, before capture would fail obscurely.
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._step(bs, variant)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream(self.device).wait_stream(side)

    def graph(self, bucket: int, variant: Optional[str] = None) -> Optional[torch.cuda.CUDAGraph]:
        """The captured graph of `bucket` and `variant` (None: the last), or None when there is none."""
        return self.graphs.get(bucket, {}).get(self.variants[-1] if variant is None else variant)

    def bucket(self, bs: int) -> Optional[int]:
        """The bucket a batch of `bs` runs in, or None when it exceeds the largest."""
        return bucket_for(self.buckets, bs)

    def run(self, bs: int, variant: Optional[str] = None) -> int:
        """Run one step of `variant` (one of `variants`; None: the last) for a batch of `bs`
        (inputs already loaded for that bucket) on the current stream; returns the padded size
        it ran at."""
        if variant is None:
            variant = self.variants[-1]
        elif variant not in self.variants:
            raise ValueError(f"variant {variant!r} is not one of the captured {self.variants}")
        padded = self.bucket(bs)
        if padded is None:
            if self.strict:
                raise ValueError(f"batch of {bs} exceeds the largest bucket {self.buckets[-1]}; add a bucket or lower the batch")
            if not self._warned:
                warnings.warn(f"batch of {bs} exceeds the largest bucket {self.buckets[-1]}: running it eagerly (warned once)")
                self._warned = True
            self._step(bs, variant)
            return bs
        graph = self.graph(padded, variant)
        if graph is None:
            self._step(padded, variant)
        else:
            graph.replay()
        return padded
