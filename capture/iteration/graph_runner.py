"""Capture a step function once per bucket, replay the smallest bucket that fits a batch.

The step is `step(bs)`: it reads and writes `[:bs]` views of static buffers and nothing else
(no host syncs, no data-dependent shapes). Capture follows what works in production engines:
warm each bucket up on a side stream (Triton kernels compile on their first call; cuBLAS
picks its workspaces), then capture largest first so every smaller graph fits in the memory
the larger ones already took from the one shared pool.
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
    nodes: dict[int, int] = {}  # bucket -> node count of its captured graph (read from the graph)


class GraphRunner:
    """One CUDA graph per bucket for `step`, all in one memory pool.

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
        use_graphs: bool = True,
        strict: bool = False,
        sync_debug: bool = True,
        progress: bool = False,
        capture_error_mode: str = "global",
    ):
        self.step = step
        self.buckets = check_buckets(buckets, max_batch)
        self.max_batch = max_batch
        self.device = torch.device(device)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.strict = strict
        self.sync_debug = sync_debug
        self.progress = progress
        self.capture_error_mode = capture_error_mode
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.report: Optional[CaptureReport] = None
        self._warned = False

    def capture(self) -> CaptureReport:
        """Warm up and capture every bucket (no-op without graphs). Call outside any capture."""
        start = time.perf_counter()
        if not self.use_graphs:
            self.report = CaptureReport(self.buckets, 0.0, 0)
            return self.report
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        order = sorted(self.buckets, reverse=True)
        # Every bucket is warmed up before any capture, so warm-up's own allocations (cached by
        # the allocator afterwards) are not counted as graph memory: the figure is the pool's.
        for bs in order:
            self._warm_up(bs, side)
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        nodes: dict[int, int] = {}
        for n, bs in enumerate(order, 1):
            if self.progress:
                print(f"\rcapturing CUDA graphs: bucket {bs:4d} ({n}/{len(order)})", end="", file=sys.stderr, flush=True)
            # keep_graph: the captured cudaGraph_t stays readable, so its nodes can be counted.
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode=self.capture_error_mode):
                self.step(bs)
            graph.instantiate()
            nodes[bs] = graph_node_count(graph.raw_cuda_graph())
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.report = CaptureReport(self.buckets, seconds, torch.cuda.memory_reserved(self.device) - reserved_before, nodes)
        if self.progress:
            print(f"\rcaptured {len(order)} CUDA graphs in {seconds:.1f} s, "
                  f"{self.report.graph_memory_bytes / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        return self.report

    def _warm_up(self, bs: int, side: torch.cuda.Stream) -> None:
        side.wait_stream(torch.cuda.current_stream(self.device))
        previous = torch.cuda.get_sync_debug_mode()
        if self.sync_debug:
            # Any host sync in the step raises here, before capture would fail obscurely.
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.step(bs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream(self.device).wait_stream(side)

    def bucket(self, bs: int) -> Optional[int]:
        """The bucket a batch of `bs` runs in, or None when it exceeds the largest."""
        return bucket_for(self.buckets, bs)

    def run(self, bs: int) -> int:
        """Run one step for a batch of `bs` (inputs already loaded for that bucket) on the
        current stream; returns the padded size it ran at."""
        padded = self.bucket(bs)
        if padded is None:
            if self.strict:
                raise ValueError(f"batch of {bs} exceeds the largest bucket {self.buckets[-1]}; add a bucket or lower the batch")
            if not self._warned:
                warnings.warn(f"batch of {bs} exceeds the largest bucket {self.buckets[-1]}: running it eagerly (warned once)")
                self._warned = True
            self.step(bs)
            return bs
        graph = self.graphs.get(padded)
        if graph is None:
            self.step(padded)
        else:
            graph.replay()
        return padded
