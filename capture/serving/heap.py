"""The serving processes' heap, set aside from the cyclic garbage collector once they start
serving.

By then a process holds hundreds of thousands of long-lived objects (the tokenizer's
vocabulary, torch's and the model's Python objects; 320k for the tiny model's server), and
every full collection walks all of them: 160 ms on a CPU core here, a stall of every stream
(or of the GPU's next launch) whenever the collector decides to run one. Profiling the HTTP
process under load found those collections inside a quarter of its CPU time. `gc.freeze`
moves what exists now into a generation the collector never scans; what serving allocates
later is collected as before. Garbage is collected first, so none is frozen with the rest
(a frozen cycle is never freed: a dropped engine's GPU memory would stay held), and the heap
is given back to the collector when serving ends (at exit, bindings such as Triton's report
objects still frozen as leaks). The entry points of serving use it (the engine process, each
API server, the in-process benchmark's sweep), around their serving only.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def frozen_startup_heap() -> Iterator[None]:
    """Collect what is garbage now, exempt every object still alive from cyclic collection
    while the block serves, then hand them back (see the module's docstring)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
