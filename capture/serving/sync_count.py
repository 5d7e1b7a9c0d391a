"""Count the host syncs torch makes inside a block, from its sync-debug mode.

torch's sync-debug mode "warn" emits a warning for every op that synchronizes the host with
the device. Inside `with HostSyncCounter(on_gpu) as syncs:` those warnings are counted (and
kept quiet) while every other warning passes on unchanged; `syncs.count` holds the total. It
sees torch's ops only: waits the caller makes itself (e.g. on cuda-python events) are not syncs
it can see. On a CPU the count stays 0 and nothing is switched.
"""

from __future__ import annotations

import warnings

import torch

# torch's sync-debug warning, word for word: the switch itself warns once per process that the
# mode "does not yet detect all synchronizing operations", which must not count as a sync.
_SYNC_WARNING = "called a synchronizing CUDA operation"


class HostSyncCounter:
    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.count = 0
        self._caught = None
        self._previous_mode = None

    def __enter__(self) -> "HostSyncCounter":
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        if self.on_gpu:
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.on_gpu:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._caught.__exit__(*exc)
        for w in self._records:
            if _SYNC_WARNING in str(w.message):
                self.count += 1
            else:  # not ours to swallow (e.g. the runner's oversize-batch warning): pass it on
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
