"""A Llama-family decoder (real weights from a GGUF, or seeded random ones) and its static
`[slot, position]` KV cache.

One path: `forward(ids, slots, positions, q-blocks)` runs a flat batch of T query tokens of any
span kinds (prompt chunks, decode rows, verify spans) through the layer stack (projections in cuBLAS
or in fused Triton skinny GEMMs, as `self.plan` picks per row count: `capture.model.linear_plan`;
the rest in fused kernels on CUDA with torch twins on the CPU: `capture.kernels`), every op
fixed-shape in T, no host syncs: it is what the engine captures per token bucket. Token t
writes its K/V at `[slots[t], positions[t]]` and attends that slot's positions
0..positions[t] through the varlen kernel, so a span is causal inside and sees its whole cached
prefix. `logits` runs the LM head over the rows that sample. `prefill` and `decode` are eager
conveniences over `forward` (tests, references).

Slot 0 is the padding slot: padding tokens (slot 0, any in-range position) only touch cache
row 0.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Sequence

import msgspec
import torch

from graphrelay.capture.kernels import gemv, gemv_tiles
from graphrelay.capture.kernels.q_blocks import Q_BLOCK, q_blocks
from graphrelay.capture.kernels.varlen_attention import VarlenWorkspace, varlen_attention
from graphrelay.capture.model.kv_cache import KVCache, resolve_kv_cache_dtype
from graphrelay.capture.model.linear_plan import SKINNY_ROWS, LinearPlan
from graphrelay.config import DTYPES
from graphrelay.runtime import to_device_async

if TYPE_CHECKING:
    from graphrelay.capture.parallel.tensor_parallel import TensorParallel

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

    def shard(self, world: int) -> "ModelConfig":
        """The shapes one of `world` tensor-parallel ranks computes: its share of the query
        heads, KV heads and MLP columns, everything else whole. Rejects sizes that do not split."""
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"tensor-parallel size must be a positive int, got {world!r}")
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            value = getattr(self, name)
            if value % world:
                raise ValueError(
                    f"tensor parallelism over {world} ranks needs {name} ({value}) divisible by {world}; "
                    f"use a model whose head and MLP sizes divide (e.g. the small, medium or llama-1b preset) or another --tp"
                )
        return msgspec.structs.replace(
            self, num_heads=self.num_heads // world, num_kv_heads=self.num_kv_heads // world,
            intermediate_size=self.intermediate_size // world, head_dim=self.head_dim,
        )

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
    # Llama-3.2-1B's architecture (1.24 B parameters), random weights only: large enough that a
    # decode step at batch 64 reads weights rather than launches nodes (what tensor parallelism
    # needs to pay); its 32 query and 8 KV heads split over 2, 4 or 8 ranks.
    "llama-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        intermediate_size=8192, max_seq_len=2048, rope_theta=500000.0, rms_eps=1e-5,
        dtype="bfloat16", tie_word_embeddings=True,
    ),
    # SmolLM2-135M's architecture: its real weights come from a GGUF (capture.checkpoint);
    # with random weights it is the benchmarks' stand-in when the file is absent.
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, max_seq_len=2048, rope_theta=100000.0, rms_eps=1e-5,
        dtype="bfloat16", tie_word_embeddings=True,
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

    def to(self, device: torch.device, dtype: torch.dtype) -> "LayerWeights":
        return LayerWeights(**{f.name: getattr(self, f.name).to(device, dtype) for f in fields(self)})


@dataclass
class ModelWeights:
    """Every weight of the decoder; `lm_head` is `embed` itself when embeddings are tied."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]

    @classmethod
    def random(cls, c: ModelConfig) -> "ModelWeights":
        """Seeded random weights in float32 on the CPU, drawn in a fixed order so every device
        and dtype gets the same model. std = fan_in ** -0.5 keeps every projection at unit scale."""
        generator = torch.Generator().manual_seed(c.seed)

        def init(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=generator) * cols**-0.5

        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        embed = init(c.vocab_size, c.hidden_size)
        layers = [
            LayerWeights(
                attn_norm=torch.ones(c.hidden_size),
                qkv=init(qkv_rows, c.hidden_size),
                o=init(c.hidden_size, c.num_heads * c.head_dim),
                mlp_norm=torch.ones(c.hidden_size),
                gate_up=init(2 * c.intermediate_size, c.hidden_size),
                down=init(c.hidden_size, c.intermediate_size),
            )
            for _ in range(c.num_layers)
        ]
        lm_head = embed if c.tie_word_embeddings else init(c.vocab_size, c.hidden_size)
        return cls(embed=embed, layers=layers, final_norm=torch.ones(c.hidden_size), lm_head=lm_head)

    def to(self, device: torch.device, dtype: torch.dtype) -> "ModelWeights":
        embed = self.embed.to(device, dtype)
        tied = self.lm_head is self.embed
        return ModelWeights(
            embed=embed,
            layers=[layer.to(device, dtype) for layer in self.layers],
            final_norm=self.final_norm.to(device, dtype),
            lm_head=embed if tied else self.lm_head.to(device, dtype),
        )

    def shard(self, c: ModelConfig, rank: int, world: int) -> "ModelWeights":
        """Rank `rank`'s slices of these (whole, `c`-shaped) weights: query heads, KV heads and
        MLP columns [rank / world, (rank + 1) / world) in the QKV and gate/up rows and the
        matching O and down columns; embedding, norms and LM head whole (replicated)."""
        self.check(c)
        if world == 1:
            return self
        local, d = c.shard(world), c.head_dim

        def rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
            return t[start + rank * count: start + (rank + 1) * count]

        def cols(t: torch.Tensor, count: int) -> torch.Tensor:
            return t[:, rank * count: (rank + 1) * count].contiguous()

        def split(layer: LayerWeights) -> LayerWeights:
            q_rows, kv_rows = c.num_heads * d, c.num_kv_heads * d
            qkv = torch.cat([rows(layer.qkv, 0, local.num_heads * d), rows(layer.qkv, q_rows, local.num_kv_heads * d),
                             rows(layer.qkv, q_rows + kv_rows, local.num_kv_heads * d)])
            gate_up = torch.cat([rows(layer.gate_up, 0, local.intermediate_size),
                                 rows(layer.gate_up, c.intermediate_size, local.intermediate_size)])
            return LayerWeights(attn_norm=layer.attn_norm, qkv=qkv, o=cols(layer.o, local.num_heads * d),
                                mlp_norm=layer.mlp_norm, gate_up=gate_up, down=cols(layer.down, local.intermediate_size))

        return ModelWeights(embed=self.embed, layers=[split(layer) for layer in self.layers],
                            final_norm=self.final_norm, lm_head=self.lm_head)

    def check(self, c: ModelConfig) -> None:
        """Every tensor has the shape `c` implies (a checkpoint that disagrees is rejected)."""
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        expected = {
            "embed": (self.embed, (c.vocab_size, c.hidden_size)),
            "final_norm": (self.final_norm, (c.hidden_size,)),
            "lm_head": (self.lm_head, (c.vocab_size, c.hidden_size)),
        }
        if len(self.layers) != c.num_layers:
            raise ValueError(f"weights have {len(self.layers)} layers but the config says {c.num_layers}")
        for i, layer in enumerate(self.layers):
            expected.update({
                f"layers[{i}].attn_norm": (layer.attn_norm, (c.hidden_size,)),
                f"layers[{i}].qkv": (layer.qkv, (qkv_rows, c.hidden_size)),
                f"layers[{i}].o": (layer.o, (c.hidden_size, c.num_heads * c.head_dim)),
                f"layers[{i}].mlp_norm": (layer.mlp_norm, (c.hidden_size,)),
                f"layers[{i}].gate_up": (layer.gate_up, (2 * c.intermediate_size, c.hidden_size)),
                f"layers[{i}].down": (layer.down, (c.hidden_size, c.intermediate_size)),
            })
        for name, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {shape}")


def rotary_table(c: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [length, head_dim] float32 for positions 0..length-1 (half-split layout)."""
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64).float() / c.head_dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [length, d/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class LlamaModel:
    """A Llama-style decoder with a static KV cache for `max_reqs` requests.

    weights: real weights (e.g. `capture.checkpoint.read_gguf`), any float dtype on any device;
    they are cast to the config's dtype on `device`. None draws seeded random weights.
    attention_buckets: the (tokens, spans) shapes `forward` is captured at (the engine's token
    buckets); they size the attention's output once (and on a GPU its split scratch; None:
    eager calls allocate their own).
    tp: this rank's place in a tensor-parallel group (`capture.tensor_parallel`): the model
    then holds its share of the heads and MLP columns (`self.shard`) and all-reduces after
    the O and down projections. `self.config` stays the whole model's.
    kv_cache_dtype: "auto" (the model's dtype) or "fp8" (`capture.model.kv_cache`).
    """

    def __init__(
        self, config: ModelConfig, max_reqs: int, device: torch.device | str, weights: "ModelWeights | None" = None,
        attention_buckets: Sequence[tuple[int, int]] | None = None, tp: "TensorParallel | None" = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if not isinstance(max_reqs, int) or max_reqs < 1:
            raise ValueError(f"max_reqs must be a positive int, got {max_reqs!r}")
        cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, config.torch_dtype)  # refused before anything is built
        self.config = config
        self.tp = tp
        world, rank = (tp.world, tp.rank) if tp is not None else (1, 0)
        self.shard = config.shard(world)  # the shapes this rank computes
        self.max_reqs = max_reqs
        # Resolved through a tensor so "cuda" becomes "cuda:0" and device checks compare equal.
        self.device = torch.empty(0, device=device).device
        weights = (weights or ModelWeights.random(config)).shard(config, rank, world)
        c = self.shard
        weights = weights.to(self.device, c.torch_dtype)
        weights.check(c)
        self.embed, self.layers, self.final_norm, self.lm_head = (
            weights.embed, weights.layers, weights.final_norm, weights.lm_head
        )

        # Rotary table, [max_seq_len, head_dim] float32: rows are gathered by position. Computed
        # in float32 the way transformers' Llama does, so float32 logits agree with it closely.
        self.rope_cos, self.rope_sin = (t.to(self.device) for t in rotary_table(c, c.max_seq_len))
        self.scale = c.head_dim**-0.5
        self.attention_workspace = None
        if self.device.type == "cuda" and attention_buckets:
            self.attention_workspace = VarlenWorkspace.for_buckets(
                attention_buckets, c.num_heads, c.num_kv_heads, c.head_dim, c.max_seq_len, self.device)
        # Split-K projection tilings' scratch, for the row counts a plan may run on Triton
        # (about 4 MB at SmolLM2-135M's width).
        self.split_workspace = None
        if self.device.type == "cuda":
            rows = min(SKINNY_ROWS, max((tokens for tokens, _ in attention_buckets or ()), default=SKINNY_ROWS))
            self.split_workspace = gemv_tiles.SplitKWorkspace(rows, c.hidden_size, self.device, max_split=4)
        # Attention writes only the tokens its q-blocks cover. Padding tokens read what this
        # buffer held: zeros, or an earlier real token's output, always finite, so a padding row
        # never carries NaN from uninitialized memory into its logits, whose sampled id would
        # then index the controls' tables out of range.
        self.attention_out = None
        if attention_buckets:
            self.attention_out = torch.zeros(max(tokens for tokens, _ in attention_buckets), c.num_heads * c.head_dim,
                                             dtype=c.torch_dtype, device=self.device)
        self.kv_cache = KVCache(
            c.num_layers, max_reqs, c.max_seq_len, c.num_kv_heads, c.head_dim, cache_dtype, self.device
        )
        # Backend per projection and row count; the engine replaces it with a measured plan
        # (`LinearPlan.measured`) before it captures.
        self.plan = LinearPlan.fixed("torch")

    # ----------------------------------------------------------------------------------------
    # Public paths

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
        q_block_start: torch.Tensor, q_block_len: torch.Tensor, q_block: int = Q_BLOCK,
        key_bound: int | None = None, embedded: torch.Tensor | None = None, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One flat batch of T query tokens of any span kinds; returns the final-normed hidden
        states [T, hidden], or with `rows` [m] (token indices) those tokens' alone, [m, hidden],
        gathered by the final norm itself. Capturable: fixed shape in T, nothing read on the host.

        ids, slots, positions [T] int64: token t is `ids[t]` at `positions[t]` of `slots[t]`;
        it writes its K/V there and attends that slot's positions 0..positions[t]. The tokens
        of one span are consecutive and `q_block_start / q_block_len` [NB] int32 split them
        into the attention kernel's query blocks of at most `q_block` tokens
        (`capture.kernels.varlen_attention`).
        Padding tokens use slot 0 and belong to no block. key_bound: a host-known bound on
        every real token's position + 1 (eager runs); the CPU's torch attention then gathers
        that many keys per token instead of max_seq_len. Masked keys weigh exactly 0, so it
        changes no bit of the result; the GPU kernel, captured at full shape, ignores it.
        embedded: `embed[ids]` [T, hidden] gathered already (the engine's fused prologue); the
        layers then update it in place as their residual stream.
        """
        c = self.shard
        max_len = key_bound if self.device.type == "cpu" else None

        def attend(index: int, q: torch.Tensor) -> torch.Tensor:  # q [T, h, d]
            return varlen_attention(
                # No block table: each slot owns a contiguous range of the cache, whose rows the
                # kernel computes instead of loading (a paged cache would pass its table here).
                q, self.kv_cache.keys[index], self.kv_cache.values[index], None, slots, positions,
                q_block_start, q_block_len, scale=self.scale, workspace=self.attention_workspace, q_block=q_block,
                max_len=max_len, out=self._attention_out(q.shape[0]),
                # The caller wrote the metadata before this forward; the QKV kernel runs between.
                metadata_settled=True,
            )

        return self._forward(ids, slots, positions, attend, embedded, rows)

    def _attention_out(self, tokens: int) -> torch.Tensor:
        """[tokens, heads * head_dim] for attention to write: the static buffer when it is large
        enough, else a zeroed one (eager calls beyond the buckets)."""
        if self.attention_out is not None and tokens <= self.attention_out.shape[0]:
            return self.attention_out[:tokens]
        c = self.shard
        return torch.zeros(tokens, c.num_heads * c.head_dim, dtype=c.torch_dtype, device=self.device)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """LM head over the rows that sample: [n, vocab] float32, or into `out` when given:
        float32 (the copy casts, one graph node fewer than casting first; widening to float32
        is exact) or the model's dtype (the GEMM writes it: no copy at all; the sampler widens
        it as it reads)."""
        if out is None:
            return self._logits(hidden)
        if out.dtype == self.lm_head.dtype:
            return torch.matmul(hidden, self.lm_head.T, out=out)
        return out.copy_(hidden @ self.lm_head.T)

    @torch.no_grad()
    def prefill(
        self, slots: Sequence[int], chunks: Sequence[Sequence[int]], starts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Eager convenience over `forward`: a batch of prompt chunks, logits [B, vocab] float32
        of each chunk's last token. Chunk b holds tokens for positions `starts[b] ..` of slot
        `slots[b]` (starts default to 0)."""
        c = self.shard
        starts = [0] * len(slots) if starts is None else list(starts)
        if not slots or not len(slots) == len(chunks) == len(starts):
            raise ValueError("prefill needs one chunk and one start per slot, and at least one slot")
        for slot, chunk, start in zip(slots, chunks, starts):
            if not isinstance(slot, int) or isinstance(slot, bool) or not 1 <= slot <= self.max_reqs:
                raise ValueError(f"prefill slot must be an int in 1..{self.max_reqs} (slot 0 is padding), got {slot!r}")
            if not isinstance(start, int) or start < 0 or not chunk or start + len(chunk) > c.max_seq_len:
                raise ValueError(
                    f"prefill chunk for slot {slot}: start {start!r} + length {len(chunk)} must fit in "
                    f"max_seq_len ({c.max_seq_len}) with at least one token"
                )
            if any(not isinstance(t, int) or not 0 <= t < c.vocab_size for t in chunk):
                raise ValueError(f"prefill chunk for slot {slot} holds a token id outside 0..{c.vocab_size - 1}")
        if len(set(slots)) != len(slots):
            raise ValueError("prefill slots repeat; give each request one chunk per batch")
        lengths = [len(chunk) for chunk in chunks]
        offsets = [sum(lengths[:b]) for b in range(len(chunks))]
        ids = [t for chunk in chunks for t in chunk]
        token_slots = [slot for slot, n in zip(slots, lengths) for _ in range(n)]
        positions = [start + i for start, n in zip(starts, lengths) for i in range(n)]
        block_start, block_len = q_blocks(lengths, offsets)
        host = torch.tensor([ids, token_slots, positions], dtype=torch.int64)
        blocks = torch.tensor([block_start, block_len], dtype=torch.int32)
        dev, dev_blocks = to_device_async(host, self.device), to_device_async(blocks, self.device)
        key_bound = max(start + n for start, n in zip(starts, lengths))
        hidden = self.forward(dev[0], dev[1], dev[2], dev_blocks[0], dev_blocks[1], key_bound=key_bound)
        last = torch.tensor([o + n - 1 for o, n in zip(offsets, lengths)])
        return self._logits(hidden.index_select(0, to_device_async(last, self.device)))

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Convenience over `forward`: one single-token span per row; logits [bs, vocab] float32.

        tokens, slots, seq_lens: [bs] int32 or int64 on the model's device. Row i writes K/V
        at [slots[i], seq_lens[i]] and attends over positions 0..seq_lens[i]; padded rows use
        slot 0 with any in-range seq len. Nothing is read on the host.
        NOTE: values are not checked (that would sync): the kernels clamp an out-of-range slot
        or position so they never touch memory outside the cache, but that row's result is then
        meaningless. The scheduler assigns slots and lengths; it is where they are checked.
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
        rows = torch.arange(bs, dtype=torch.int32, device=self.device)
        hidden = self.forward(tokens.long(), slots.long(), seq_lens.long(), rows, torch.ones_like(rows), q_block=1)
        return self.logits(hidden, out)

    # ----------------------------------------------------------------------------------------
    # Shared layer stack

    def _forward(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor], torch.Tensor],
        embedded: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run all layers for n query rows; row i sits at `positions[i]` of slot `slots[i]`.

        attend(layer, q [n, h, d]) -> [n, h * d] attends over the cache after this step's K/V
        were written. Returns the final-normed hidden [n, hidden] (rows: of those rows only,
        [m, hidden]). Per layer, with every
        projection on torch (`self.plan`): add + norm, QKV GEMM, rotary + cache write,
        attention, O GEMM, add + norm, gate/up GEMM, SiLU-mul, down GEMM (an O / down output
        stays pending until the next norm adds it); with every projection on Triton: norm +
        QKV + rotary + cache write, attention, O + add, norm + gate/up + SiLU-mul, down + add.
        """
        c = self.shard
        ops = self.plan.ops(tokens.shape[0], c.rms_eps, self._all_reduce, self.split_workspace)
        # The residual stream [n, hidden], unless the caller gathered it (`forward`'s embedded).
        update, stream = None, self.embed.index_select(0, tokens) if embedded is None else embedded
        for index, layer in enumerate(self.layers):
            # Past the first layer, positions and slots were written long before (the caller, or
            # the iteration prologue just before layer 0's projection).
            rotary = gemv.Rotary(self.rope_cos, self.rope_sin, positions, slots, self.kv_cache.keys[index],
                                 self.kv_cache.values[index], c.num_heads, c.num_kv_heads, settled=index > 0)
            q, stream = ops.qkv(update, stream, layer, rotary)
            update, stream = ops.o(attend(index, q), stream, layer)
            act, stream = ops.gate_up(update, stream, layer)
            update, stream = ops.down(act, stream, layer)
        return ops.final_norm(update, stream, self.final_norm, rows)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism each rank's O / down projection is a partial sum."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head.T).float()  # [n, vocab]
