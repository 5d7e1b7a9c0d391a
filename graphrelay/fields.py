"""The relay's field table, and the typed structs that carry one batch of field values.

A relay field is a per-slot row `[*shape]` of one dtype. The table is fixed by the config,
in a fixed order: `stash` fields first (tokens, then speculative extras), then `publish`
fields (seq lens, then confidence). The kernels walk this table; `RelayPayload` and
`Resolved` name the same fields as attributes.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import msgspec
import torch

from graphrelay.config import PUBLISH_FIELDS, STASH_FIELDS, RelayConfig

STASH = "stash"
PUBLISH = "publish"


class Field(msgspec.Struct, frozen=True):
    """One relay field: its attribute name, per-slot shape, storage dtype and padding value."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: str  # STASH or PUBLISH: which op writes it
    fill: float  # what padding row 0 holds, so gathers at index 0 return it

    @property
    def width(self) -> int:
        """Elements per slot row."""
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point


def relay_fields(config: RelayConfig) -> tuple[Field, ...]:
    """The enabled fields of `config`, stash group first, in a stable order."""
    fields = [Field("tokens", (), config.token_torch_dtype, STASH, config.pad_token_id)]
    for name in STASH_FIELDS:
        spec = getattr(config, name)
        if spec is not None:
            fields.append(Field(name, spec.shape, spec.torch_dtype, STASH, 0))
    fields.append(Field("seq_lens", (), config.seq_len_torch_dtype, PUBLISH, config.seq_len_fill))
    for name in PUBLISH_FIELDS:
        spec = getattr(config, name)
        if spec is not None:
            fields.append(Field(name, spec.shape, spec.torch_dtype, PUBLISH, 0))
    return tuple(fields)


class RelayPayload(msgspec.Struct):
    """What `stash` writes for one batch: tensors `[bs, *field shape]`, one per enabled stash
    field. Fields the config does not enable must stay None."""

    tokens: torch.Tensor  # [bs] sampled (bonus) tokens
    topk_p: Optional[torch.Tensor] = None  # [bs, topk]
    topk_index: Optional[torch.Tensor] = None  # [bs, topk]
    hidden: Optional[torch.Tensor] = None  # [bs, hidden_size]
    draft_probs: Optional[torch.Tensor] = None  # [bs, num_draft]
    sparse_topk: Optional[torch.Tensor] = None  # [bs, k]
    accepted_tokens: Optional[torch.Tensor] = None  # [bs, max_accept]
    accept_len: Optional[torch.Tensor] = None  # [bs]

    def narrow(self, bs: int) -> "RelayPayload":
        """`[:bs]` views of every present tensor: a bucket's view of max-shape static buffers."""
        return _narrow(self, bs)


class Resolved(msgspec.Struct):
    """What `resolve` gathers for one batch: tensors `[bs, *field shape]` for every field it
    read (every enabled field, or the `fields=` subset); None for the others."""

    tokens: Optional[torch.Tensor] = None  # [bs] next input ids
    seq_lens: Optional[torch.Tensor] = None  # [bs] tokens already in each slot's KV cache
    topk_p: Optional[torch.Tensor] = None
    topk_index: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None
    draft_probs: Optional[torch.Tensor] = None
    sparse_topk: Optional[torch.Tensor] = None
    accepted_tokens: Optional[torch.Tensor] = None
    accept_len: Optional[torch.Tensor] = None
    confidence: Optional[torch.Tensor] = None

    def narrow(self, bs: int) -> "Resolved":
        """`[:bs]` views of every present tensor."""
        return _narrow(self, bs)


def _narrow(struct, bs: int):
    views = {
        name: (None if value is None else value[:bs])
        for name in struct.__struct_fields__
        for value in (getattr(struct, name),)
    }
    return type(struct)(**views)


def allocate(cls, fields: tuple[Field, ...], batch: int, device: torch.device, dtypes: Optional[Mapping[str, torch.dtype]] = None):
    """A `cls` (RelayPayload or Resolved) of zeroed `[batch, *shape]` buffers for `fields`, in
    their storage dtypes unless `dtypes` names another: the static buffers a captured graph binds."""
    own = set(cls.__struct_fields__)
    dtypes = dtypes or {}
    tensors = {
        f.name: torch.zeros((batch, *f.shape), dtype=dtypes.get(f.name, f.dtype), device=device)
        for f in fields
        if f.name in own
    }
    return cls(**tensors)
