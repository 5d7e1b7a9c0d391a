"""A small Llama-style decoder with seeded random weights and a static KV cache.

Two paths share one layer stack:

- `prefill(slot, token_ids)`: eager, one request, writes `cache[slot, 0:L]`.
- `decode(tokens, slots, seq_lens)`: one token per row, every op fixed-shape in the bucket
  size `bs`, no host syncs, nothing sized by data: it can be captured in a CUDA graph.

Seq-len convention: `seq_lens[i]` is the number of tokens already cached for slot i, which is
also the position of row i's input token. A decode step writes K/V at `[slot, seq_len]`,
attends over positions `0..seq_len`, and the caller then publishes `seq_len + 1`.
Slot 0 is the padding slot: padded rows (slot 0, any in-range seq len) only touch cache row 0.

`reference_logits` recomputes a sequence from scratch without the cache, for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import msgspec
import torch

from capture.kv_cache import KVCache
from graphrelay.config import DTYPES
from graphrelay.runtime import to_device_async

MODEL_DTYPES = ("float32", "bfloat16", "float16")


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Model sizes; the defaults are the `tiny` preset, which runs fast on a CPU."""

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: derived as hidden_size // num_heads
    intermediate_size: int = 128
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    dtype: str = "float32"
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"ModelConfig.head_dim: hidden_size ({self.hidden_size}) is not divisible by "
                    f"num_heads ({self.num_heads}); set head_dim explicitly"
                )
            msgspec.structs.force_setattr(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim must be a positive even int (rotary pairs), got {self.head_dim}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise ValueError(f"ModelConfig.seed must be an int in 0..2**63-1, got {self.seed!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_eps > 0:
            raise ValueError(f"ModelConfig.rms_eps must be > 0, got {self.rms_eps}")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"ModelConfig.dtype {self.dtype!r} is not supported; use one of {MODEL_DTYPES}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {name!r}; use one of {sorted(MODEL_PRESETS)}")
        return MODEL_PRESETS[name]


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(
        vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8,
        intermediate_size=2816, max_seq_len=2048, dtype="bfloat16",
    ),
    "medium": ModelConfig(
        vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8,
        intermediate_size=5632, max_seq_len=2048, dtype="bfloat16",
    ),
}


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in float32, scale in the model dtype (Llama's order)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu_mlp(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    gate, up = (x @ layer.gate_up.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ layer.down.T


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split pairing. x: [n, heads, d]; cos, sin: [n, d] float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def split_qkv(config: ModelConfig, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[n, (h + 2 kvh) * d] -> q [n, h, d], k [n, kvh, d], v [n, kvh, d]."""
    n, d = qkv.shape[0], config.head_dim
    q, k, v = qkv.split([config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d], -1)
    return q.view(n, config.num_heads, d), k.view(n, config.num_kv_heads, d), v.view(n, config.num_kv_heads, d)


class LlamaModel:
    """Seeded random Llama-style decoder with a static KV cache for `max_reqs` requests."""

    def __init__(self, config: ModelConfig, max_reqs: int, device: torch.device | str) -> None:
        if not isinstance(max_reqs, int) or max_reqs < 1:
            raise ValueError(f"max_reqs must be a positive int, got {max_reqs!r}")
        self.config = config
        self.max_reqs = max_reqs
        # Resolved through a tensor so "cuda" becomes "cuda:0" and device checks compare equal.
        self.device = torch.empty(0, device=device).device
        c, dtype = config, config.torch_dtype
        generator = torch.Generator().manual_seed(c.seed)

        # Weights are drawn on the CPU in a fixed order, so every device gets the same model.
        # std = fan_in ** -0.5 keeps every projection's output at unit scale.
        def init(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=generator) * cols**-0.5
            return w.to(device=self.device, dtype=dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=dtype)

        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.embed = init(c.vocab_size, c.hidden_size)  # [vocab, hidden]
        self.layers = [
            LayerWeights(
                attn_norm=ones(c.hidden_size),
                qkv=init(qkv_rows, c.hidden_size),
                o=init(c.hidden_size, c.num_heads * c.head_dim),
                mlp_norm=ones(c.hidden_size),
                gate_up=init(2 * c.intermediate_size, c.hidden_size),
                down=init(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = ones(c.hidden_size)
        self.lm_head = self.embed if c.tie_word_embeddings else init(c.vocab_size, c.hidden_size)

        # Rotary table, [max_seq_len, head_dim] float32: decode gathers rows by position.
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
        angles = torch.arange(c.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        self.rope_cos = angles.cos().float().to(self.device)
        self.rope_sin = angles.sin().float().to(self.device)
        # [max_seq_len] int64: compared against seq lens to build the attention mask on device.
        self.cache_positions = torch.arange(c.max_seq_len, device=self.device)

        self.kv_cache = KVCache(
            c.num_layers, max_reqs, c.max_seq_len, c.num_kv_heads, c.head_dim, dtype, self.device
        )

    # ----------------------------------------------------------------------------------------
    # Public paths

    @torch.no_grad()
    def prefill(self, slot: int, token_ids: torch.Tensor) -> torch.Tensor:
        """Run a prompt for one request eagerly; writes cache[slot, 0:L]. Returns [vocab] f32."""
        c = self.config
        if not isinstance(slot, int) or isinstance(slot, bool) or not 1 <= slot <= self.max_reqs:
            raise ValueError(
                f"prefill slot must be an int in 1..{self.max_reqs} (slot 0 is padding), got {slot!r}"
            )
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError("prefill token_ids must be a 1-D integer tensor [L]")
        length = token_ids.shape[0]
        if not 1 <= length <= c.max_seq_len:
            raise ValueError(
                f"prefill token_ids length {length} must be in 1..max_seq_len ({c.max_seq_len})"
            )
        # Checked on the host when the prompt comes from the host (no sync), then staged
        # through pinned memory (no wait for the stream's queued work).
        self._check_range("token_ids", token_ids, c.vocab_size)
        if token_ids.device.type == "cpu":
            token_ids = to_device_async(token_ids.to(torch.int64), self.device)
        else:
            token_ids = token_ids.to(self.device, torch.int64)
        positions = self.cache_positions[:length]  # [L]
        slots = torch.full((length,), slot, dtype=torch.int64, device=self.device)
        hidden = self._forward(
            token_ids, slots, positions, lambda layer: self.kv_cache.slot_rows(layer, slot, length)
        )
        return self._logits(hidden[-1:])[0]

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step for a bucket of `bs` rows; returns logits [bs, vocab] float32.

        tokens, slots, seq_lens: [bs] int32 or int64 on the model's device. Row i writes K/V
        at [slots[i], seq_lens[i]] and attends over positions 0..seq_lens[i]; padded rows use
        slot 0 with any in-range seq len. Capturable: only metadata is checked here.
        NOTE: values are not checked (that would sync): a seq len >= max_seq_len or a slot
        > max_reqs trips a device-side assert on CUDA. `validate_decode_inputs` checks them.
        """
        bs = tokens.shape[0] if tokens.dim() == 1 else -1
        for name, t in (("tokens", tokens), ("slots", slots), ("seq_lens", seq_lens)):
            if t.dim() != 1 or t.shape[0] != bs:
                raise ValueError(f"decode {name} must be 1-D with the same length as tokens, got {tuple(t.shape)}")
            if t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"decode {name} must be int32 or int64, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"decode {name} is on {t.device}; move it to the model's device {self.device}")
        if out is not None and (out.shape != (bs, self.config.vocab_size) or out.dtype != torch.float32
                                or out.device != self.device):
            raise ValueError(f"decode out must be a float32 [{bs}, {self.config.vocab_size}] tensor on {self.device}")
        slots64, positions = slots.long(), seq_lens.long()
        hidden = self._forward(tokens, slots64, positions, lambda layer: self.kv_cache.rows(layer, slots64))
        logits = self._logits(hidden)
        return logits if out is None else out.copy_(logits)

    def validate_decode_inputs(self, tokens: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Value checks for decode inputs. NOTE: syncs with the device; never call it in a capture."""
        self._check_range("tokens", tokens, self.config.vocab_size)
        self._check_range("slots", slots, self.max_reqs + 1)
        # The step writes at position seq_len, so it must be a cache position.
        self._check_range("seq_lens", seq_lens, self.config.max_seq_len)
        live = slots[slots != 0]
        if live.unique().numel() != live.numel():
            raise ValueError("decode slots repeat a non-zero slot; each request appears at most once per batch")

    # ----------------------------------------------------------------------------------------
    # Shared layer stack

    def _forward(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Run all layers for n query rows; row i sits at `positions[i]` of slot `slots[i]`.

        cache_rows(layer) gives the keys/values each row attends over, [n, max_seq_len, kvh, d],
        read after this step's K/V are written. Returns the final-normed hidden [n, hidden].
        """
        c = self.config
        x = self.embed.index_select(0, tokens)  # [n, hidden]
        cos = self.rope_cos.index_select(0, positions)  # [n, d]
        sin = self.rope_sin.index_select(0, positions)  # [n, d]
        # Additive mask from a position comparison (no boolean indexing): [n, max_seq_len].
        visible = self.cache_positions[None, :] <= positions[:, None]
        mask = torch.where(visible, 0.0, float("-inf"))
        for index, layer in enumerate(self.layers):
            q, k, v = split_qkv(c, rms_norm(x, layer.attn_norm, c.rms_eps) @ layer.qkv.T)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            self.kv_cache.write(index, slots, positions, k, v)
            keys, values = cache_rows(index)
            x = x + self._attend(q, keys, values, mask) @ layer.o.T
            x = x + swiglu_mlp(rms_norm(x, layer.mlp_norm, c.rms_eps), layer)
        return rms_norm(x, self.final_norm, c.rms_eps)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention of one query per row over its cache rows.

        q: [n, h, d]; keys, values: [n, S, kvh, d]; mask: [n, S] additive. Returns [n, h * d].
        """
        c = self.config
        n = q.shape[0]
        q = q.view(n, c.num_kv_heads, c.kv_groups, c.head_dim)  # [n, kvh, g, d]
        # Scores in the model dtype (fp32 accumulate on GPU), softmax in float32.
        scores = torch.einsum("nkgd,nskd->nkgs", q, keys).float()  # [n, kvh, g, S]
        scores = scores * c.head_dim**-0.5 + mask[:, None, None, :]
        probs = scores.softmax(dim=-1).to(values.dtype)
        out = torch.einsum("nkgs,nskd->nkgd", probs, values)  # [n, kvh, g, d]
        return out.reshape(n, c.num_heads * c.head_dim)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head.T).float()  # [n, vocab]

    @staticmethod
    def _check_range(name: str, values: torch.Tensor, upper: int) -> None:
        if values.numel() and not bool(((values >= 0) & (values < upper)).all()):
            bad = values[(values < 0) | (values >= upper)][0].item()
            raise ValueError(f"{name} holds {bad}, outside 0..{upper - 1}")


@torch.no_grad()
def reference_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    """Slow reference: logits [vocab] f32 of the last position, recomputed without the cache.

    Plain causal attention over the whole sequence, KV heads repeated for GQA, rotary angles
    computed afresh; shares only the weights and the norm/MLP helpers with the model.
    """
    c = model.config
    n = len(token_ids)
    tokens = torch.tensor(token_ids, dtype=torch.int64, device=model.device)
    x = model.embed[tokens]  # [n, hidden]
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1).to(model.device)
    cos, sin = angles.cos().float(), angles.sin().float()  # [n, d]
    causal = torch.full((n, n), float("-inf"), device=model.device).triu(1)  # [n, n]
    for layer in model.layers:
        q, k, v = split_qkv(c, rms_norm(x, layer.attn_norm, c.rms_eps) @ layer.qkv.T)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k = k.repeat_interleave(c.kv_groups, dim=1)  # [n, h, d]
        v = v.repeat_interleave(c.kv_groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(c.head_dim) + causal
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(x.dtype)
        x = x + attn.reshape(n, -1) @ layer.o.T
        x = x + swiglu_mlp(rms_norm(x, layer.mlp_norm, c.rms_eps), layer)
    x = rms_norm(x, model.final_norm, c.rms_eps)
    return (x[-1] @ model.lm_head.T).float()
