"""A slow, independent reference for the model: logits recomputed from scratch without the
cache, with plain torch ops (tests only)."""

from __future__ import annotations

import math

import torch

from graphrelay.capture.kernels.layer_kernels import rotate, to_cache_dtype
from graphrelay.capture.model.model import LayerWeights, LlamaModel, ModelConfig, rotary_table


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in float32, scale in the model dtype (Llama's order)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu_mlp(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    gate, up = (x @ layer.gate_up.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ layer.down.T


def split_qkv(config: ModelConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[n, (h + 2 kvh) * d] -> q [n, h, d], k [n, kvh, d], v [n, kvh, d]."""
    n, d = qkv.shape[0], config.head_dim
    q, k, v = qkv.split([config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d], -1)
    return q.view(n, config.num_heads, d), k.view(n, config.num_kv_heads, d), v.view(n, config.num_kv_heads, d)


@torch.no_grad()
def reference_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Slow reference: logits [vocab] f32 of the last position, recomputed without the cache.

    Plain causal attention over the whole sequence, KV heads repeated for GQA, rotary angles
    taken from the same table, K and V rounded to the model's cache dtype; shares only the
    weights and the norm/MLP helpers with the model.
    """
    c = model.config
    n = len(token_ids)
    tokens = torch.tensor(token_ids, dtype=torch.int64, device=model.device)
    x = model.embed[tokens]  # [n, hidden]
    cos, sin = (t.to(model.device) for t in rotary_table(c, n))  # [n, d]
    causal = torch.full((n, n), float("-inf"), device=model.device).triu(1)  # [n, n]
    for layer in model.layers:
        q, k, v = split_qkv(c, rms_norm(x, layer.attn_norm, c.rms_eps) @ layer.qkv.T)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # K and V as the model's cache holds them: a float8 cache (capture.model.kv_cache)
        # rounds them, a cache of the model dtype leaves them as they are.
        k, v = (to_cache_dtype(t, model.kv_cache.keys[0].dtype).to(x.dtype) for t in (k, v))
        k = k.repeat_interleave(c.kv_groups, dim=1)  # [n, h, d]
        v = v.repeat_interleave(c.kv_groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(c.head_dim) + causal
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(x.dtype)
        x = x + attn.reshape(n, -1) @ layer.o.T
        x = x + swiglu_mlp(rms_norm(x, layer.mlp_norm, c.rms_eps), layer)
    x = rms_norm(x, model.final_norm, c.rms_eps)
    return (x[-1] @ model.lm_head.T).float()
