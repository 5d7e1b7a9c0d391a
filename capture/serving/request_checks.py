"""Whether requests fit an engine, judged from its `EngineConfig` alone.

Run before the engine is built (and before tensor-parallel ranks spawn), so a request the
engine cannot hold fails the whole run at its start, naming the request, the field and the
fix, instead of failing mid-run after other requests finished. Each check mirrors a place the
engine stores the value: a top-k column of int32 at most `max_top_k` wide, float32
temperatures, the model's vocabulary and context.
"""

from __future__ import annotations

from typing import Sequence

import torch

from graphrelay.capture.iteration.engine import EngineConfig
from graphrelay.capture.iteration.sampling import SamplingParams
from graphrelay.capture.serving.workloads import Request

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_requests(requests: Sequence[Request], config: EngineConfig) -> None:
    """Raise ValueError for the first request `config`'s engine cannot run; changes nothing."""
    model = config.model
    seen: set[str] = set()
    for r in requests:
        where = f"request {r.id!r}"
        if r.id in seen:
            raise ValueError(f"{where}: duplicate request id; request ids must be unique")
        seen.add(r.id)
        if len(r.prompt) + r.max_new_tokens > model.max_seq_len:
            raise ValueError(f"{where}: prompt ({len(r.prompt)}) + max_new_tokens ({r.max_new_tokens}) "
                             f"exceeds the model's max_seq_len {model.max_seq_len}")
        if max(r.prompt) >= model.vocab_size:
            raise ValueError(f"{where}: token id {max(r.prompt)} >= vocab_size {model.vocab_size}")
        never = [t for t in r.stop_tokens if t >= model.vocab_size]
        if never:
            raise ValueError(f"{where}: stop token {never[0]} is outside the vocabulary 0..{model.vocab_size - 1}, "
                             f"so it could never match; give ids the model can sample")
        check_sampling(where, r.sampling, config.max_top_k)


def check_sampling(where: str, params: SamplingParams, max_top_k) -> None:
    """`params` as the engine stages them per row (int32 top-k, float32 temperature)."""
    if max_top_k is not None and params.top_k > max_top_k:
        raise ValueError(f"{where}: sampling top_k {params.top_k} is above the engine's top-k width {max_top_k} "
                         f"(--max-top-k, EngineConfig.max_top_k); lower top_k (0 = no cut) or raise --max-top-k")
    if params.top_k > INT32_MAX:
        raise ValueError(f"{where}: sampling top_k {params.top_k} does not fit the engine's int32 top-k column "
                         f"(at most {INT32_MAX}); use 0 for no cut")
    if params.temperature > FLOAT32_MAX:
        raise ValueError(f"{where}: sampling temperature {params.temperature} overflows float32 (at most "
                         f"{FLOAT32_MAX:.4g}); give a smaller temperature")
