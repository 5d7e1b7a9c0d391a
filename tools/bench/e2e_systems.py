"""The systems `graphrelay bench e2e` compares, and the memory floor of one decode step.

Each runner serves the same B seeded random prompts of P tokens for N greedy tokens (no stop
tokens, so every request makes exactly N) on the same model shape with random weights, and
returns its measurements (the keys of an `e2e` row):

- graphrelay: the project's engine (one CUDA graph, bucket B) under the overlap-scheduled
  serving loop; the decode step is the GPU time of one graph replay, from the loop's events.
- hf-static / hf-dynamic: transformers' `generate` on a `LlamaForCausalLM` of the same shape,
  with a static cache (which transformers compiles on first use) or the default dynamic one.
  `generate` exposes no per-step timing, so the step comes from timed calls making 1, 2 and N
  tokens: T_1 (prefill + first token) is the time to first token, and the step is
  (T_N - T_2) / (N - 2). Differencing against T_2 rather than T_1 keeps what each call pays
  once, at its first decode step (allocating a fresh static cache, re-recording the compiled
  CUDA graphs for it), out of the step; the row's note gives that first decode step's cost.

Both systems' timed calls run with the heap frozen (`capture.serving.heap`), as the server's
processes and `bench serve` serve: a full collection of the objects a fresh engine or a compiled
model leaves behind stalls the host for tens of milliseconds, whichever system it lands in.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import msgspec
import torch

from graphrelay.capture.iteration.engine import DEFAULT_MAX_TOKENS, Engine, EngineConfig
from graphrelay.capture.serving.heap import frozen_startup_heap
from graphrelay.capture.serving.loop import ServingLoop
from graphrelay.capture.model.model import ModelConfig
from graphrelay.capture.serving.workloads import Request

# The HBM read bandwidth a streaming kernel reaches on an H200 (of 4.8 TB/s peak): the floor
# assumes the decode step does nothing but read weights and KV cache at this rate.
HBM_BYTES_PER_S = 4.2e12
TOP_K_WIDTH = 64  # `graphrelay serve`'s --max-top-k default; greedy rows need only the argmax
WARM_OUTPUT_LEN = 8  # tokens per request in graphrelay's untimed run: enough decode iterations to warm every path


def prompts(vocab_size: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """B random prompts, the same for every system and in every run (split runs must agree)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + batch * 10_007 + prompt_len)
    return torch.randint(vocab_size, (batch, prompt_len), generator=generator).tolist()


def weight_bytes(model: ModelConfig) -> int:
    """Bytes of every weight one decode step reads: the embedding (also the LM head when
    tied, read twice but counted once: the floor is a bound), per layer the fused QKV, O,
    fused gate/up and down projections and two RMSNorm weights, and the final norm."""
    d, heads, kv_heads = model.hidden_size, model.num_heads, model.num_kv_heads
    per_layer = (heads + 2 * kv_heads) * model.head_dim * d + d * heads * model.head_dim + 3 * d * model.intermediate_size + 2 * d
    embeddings = model.vocab_size * d * (1 if model.tie_word_embeddings else 2)
    return (embeddings + model.num_layers * per_layer + d) * _itemsize(model)


def kv_bytes_per_step(model: ModelConfig, batch: int, prompt_len: int, output_len: int) -> float:
    """KV cache bytes one decode step reads, averaged over the N - 1 decode steps: step i
    attends P + i positions (K and V, every layer and KV head), so the mean is P + N / 2."""
    mean_context = prompt_len + output_len / 2
    return batch * mean_context * model.num_layers * 2 * model.num_kv_heads * model.head_dim * _itemsize(model)


def floor_us(model: ModelConfig, batch: int, prompt_len: int, output_len: int) -> float:
    """The decode step can be no faster than reading its weights and KV cache once from HBM."""
    nbytes = weight_bytes(model) + kv_bytes_per_step(model, batch, prompt_len, output_len)
    return nbytes / HBM_BYTES_PER_S * 1e6


def _itemsize(model: ModelConfig) -> int:
    return torch.empty((), dtype=model.torch_dtype).element_size()


def release(device: torch.device) -> None:
    """Give the last system's memory back before the next one is built: engines and HF models
    hold reference cycles, so collect them before emptying the allocator's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- graphrelay ---------------------------------------------------------------------------


def run_graphrelay(model: ModelConfig, batch_prompts: list[list[int]], output_len: int, device: torch.device) -> dict[str, Any]:
    batch, prompt_len = len(batch_prompts), len(batch_prompts[0])
    config = msgspec.structs.replace(model, max_seq_len=prompt_len + output_len)
    # The engine's default token budget and buckets: prompts are chunked into iterations of at
    # most DEFAULT_MAX_TOKENS, as a user's engine would run them.
    engine = Engine(EngineConfig(config, max_reqs=batch, max_batch=batch, device=str(device), use_graphs=device.type == "cuda",
                                 max_top_k=TOP_K_WIDTH, max_tokens=max(DEFAULT_MAX_TOKENS, batch)))
    capture = engine.capture()

    def requests(tag: str, n: int) -> list[Request]:
        return [Request(id=f"{tag}{i}", prompt=p, max_new_tokens=n) for i, p in enumerate(batch_prompts)]

    # Untimed: the full-size prefill (its kernels compile and its memory is allocated here).
    ServingLoop(engine, "overlap").run(requests("warm", min(output_len, WARM_OUTPUT_LEN)))
    with frozen_startup_heap():
        result = ServingLoop(engine, "overlap").run(requests("r", output_len))
    short = [o.id for o in result.outputs.values() if len(o.tokens) != output_len]
    if short:
        raise RuntimeError(f"graphrelay: {len(short)} requests (e.g. {short[0]}) did not make {output_len} tokens")
    stats = result.stats
    iter_us = stats.iter_ms_median * 1e3
    step_us, note = stats.gpu_step_us_median, f"graph bucket {batch} tokens, overlap loop, {stats.iterations} iterations"
    if step_us is None:  # no GPU events on a CPU run: the host interval is the only clock
        step_us, note = iter_us, f"eager on {device.type}: step = host iteration interval, {stats.iterations} iterations"
    ttfts = [o.ttft_ms for o in result.outputs.values()]
    return {
        "decode_step_us": step_us,
        "iter_us_median": iter_us,
        "decode_tokens_per_s": batch / (step_us * 1e-6),
        "tokens_per_s": batch * output_len / stats.wall_s,
        "ttft_ms": sum(ttfts) / len(ttfts),
        "capture_s": capture.seconds,
        "graph_nodes": capture.nodes.get(batch),  # None on CPU: nothing captured
        "note": note,
    }


# ---- transformers -------------------------------------------------------------------------


def hf_config(model: ModelConfig, max_positions: int):
    """A LlamaConfig of the same shape. No BOS/EOS: nothing may stop a request early."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim, rms_norm_eps=model.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        tie_word_embeddings=model.tie_word_embeddings, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None,
    )


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run_hf(model: ModelConfig, batch_prompts: list[list[int]], output_len: int, device: torch.device,
           *, static: bool, repeats: int) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()  # generate's per-call advice would bury the rows
    batch, prompt_len = len(batch_prompts), len(batch_prompts[0])
    if static:
        # A fresh compile for each shape: dynamo's code cache is shared by every model
        # instance, and across cells it would hit its recompile limit (then run eager) or
        # switch to dynamic shapes, either of which would understate the baseline.
        torch._dynamo.reset()
    torch.manual_seed(model.seed)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(hf_config(model, prompt_len + output_len))
    hf = hf.to(dtype=model.torch_dtype).eval()
    ids = torch.tensor(batch_prompts, device=device)
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                   cache_implementation="static" if static else None)

    def seconds(new_tokens: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **options)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if tuple(out.shape) != (batch, prompt_len + new_tokens):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(batch, prompt_len + new_tokens)}")
        return elapsed

    # Untimed: the same calls as the timed ones, so compilation (hf-static), CUDA-graph
    # recording and first-use allocations all happen here.
    timed: dict[int, list[float]] = {1: [], 2: [], output_len: []}
    warm_start = time.perf_counter()
    for new_tokens in reversed(timed):  # N first: the static cache is sized for it from the start
        seconds(new_tokens)
    warm_s = time.perf_counter() - warm_start
    graphs_before = _compiled_graphs()
    with frozen_startup_heap():
        for _ in range(repeats):
            for new_tokens, times in timed.items():
                times.append(seconds(new_tokens))
    t_first, t_second, t_full = (statistics.median(timed[n]) for n in (1, 2, output_len))
    recompiled = _compiled_graphs() - graphs_before

    note = (f"torch.compile by transformers (static cache), {warm_s:.0f} s warm-up" if static
            else f"eager, dynamic cache, {warm_s:.1f} s warm-up")
    note += f", median of {repeats}, first decode step {(t_second - t_first) * 1e3:.2f} ms"
    if recompiled:
        note += f"; WARNING: {recompiled} graphs compiled while timed, times include compilation"
    step_s = (t_full - t_second) / (output_len - 2)
    if step_s <= 0:
        note += "; T_N <= T_2: no decode step could be derived"
    return {
        "decode_step_us": step_s * 1e6 if step_s > 0 else None,
        "decode_tokens_per_s": batch / step_s if step_s > 0 else None,
        "tokens_per_s": batch * output_len / t_full,
        "ttft_ms": t_first * 1e3,
        "note": note,
    }
