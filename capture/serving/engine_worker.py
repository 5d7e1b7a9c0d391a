"""The engine thread behind the HTTP server (`--engine-placement thread`; the default is its
own process, `engine_process`).

One thread, the only one that touches the GPU, runs `ServingLoop.serve` for the server's
whole life. The asyncio side talks to it through the loop's `Inbox` (submit, abort, close:
never blocking the engine) and hears back through this worker, the loop's `Sink`, which posts
results to the asyncio side in batches (`engine_handle.EngineHandle`). Sampling controls are
checked (and grammars compiled) on the HTTP side's prepare thread, against the engine's own
`SamplingControls`, before `submit`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback

import torch

from graphrelay.capture.serving.engine_handle import EngineHandle, EngineInfo
from graphrelay.capture.serving.inbox import Inbox
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.serving.workloads import Request


class EngineWorker(EngineHandle):
    def __init__(self, loop: ServingLoop, max_waiting: int):
        super().__init__(EngineInfo.of(loop.engine), max_waiting)
        self.serving = loop
        self.inbox = Inbox()
        # The engine thread's CUDA device, fixed here: "cuda" without an index means the device
        # current on the thread that built the engine, which a new thread does not inherit.
        device = loop.engine.device if loop.engine.on_gpu else None
        self._cuda_index = None if device is None else (
            device.index if device.index is not None else torch.cuda.current_device())
        self._thread = threading.Thread(target=self._main, name="graphrelay-engine", daemon=True)

    @property
    def controls(self):
        return self.serving.engine.controls

    # ---- asyncio side -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will `submit`."""
        self._bind()
        self._thread.start()

    def submit(self, request: Request):
        """Queue `request` (already validated); its events arrive on the returned queue."""
        queue = self._register(request)
        self.inbox.submit(request)
        return queue

    def abort(self, request_id: str) -> None:
        self.inbox.abort(request_id)

    async def stop(self) -> None:
        """Admit nothing more, let the engine finish what it holds, wait for its thread."""
        self.inbox.close()
        await asyncio.to_thread(self._thread.join)

    def running(self) -> bool:
        return self._thread.is_alive()

    def occupancy(self) -> dict:
        return self.serving.occupancy()  # the engine's memory is this process's

    # ---- engine thread (the loop's Sink) ------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)
            self.stats = self.serving.serve(self.inbox, self)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request and /health
            print("graphrelay serve: the engine thread failed:", file=sys.stderr)
            traceback.print_exc()
            self._fail(exc)
