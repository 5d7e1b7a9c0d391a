"""Relay configuration: every field the relay carries, declared with its shape up front.

A relay is sized once, from this config, and never from a payload (docs/design.md §2.1).
`RelayConfig` is frozen and validated where it is built; a bad value raises `ValueError`
naming the field and the fix. It loads from JSON or TOML through msgspec.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import msgspec
import torch

# dtype names accepted in configs, mapped to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
INT_DTYPES = frozenset({"int8", "int16", "int32", "int64"})


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """A boolean environment variable: 1/0, true/false, yes/no, on/off in any case, unset or
    empty = off. Anything else raises, rather than a typo silently meaning off."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off "
        "(any case; empty means off)"
    )


class FieldSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-slot shape and dtype of one optional relay field: a row is `[*shape]`."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"FieldSpec.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPES)}"
            )
        if len(self.shape) > 2 or any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise ValueError(
                f"FieldSpec.shape {self.shape!r} must be 0 to 2 positive ints per slot, "
                "e.g. [8] for top-k 8 or [4096] for a hidden state"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# Optional fields, grouped by which op writes them. `stash` carries the sampled tokens and the
# speculative-decoding extras; `publish` carries the new sequence lengths and confidence.
STASH_FIELDS = (
    "topk_p",  # EAGLE top-k draft probabilities            [topk]
    "topk_index",  # EAGLE top-k draft token ids                [topk]
    "hidden",  # EAGLE hidden states                        [hidden_size]
    "draft_probs",  # draft probabilities                        [num_draft]
    "sparse_topk",  # sparse-attention top-k indices             [k]
    "accepted_tokens",  # n-gram accepted tokens                     [max_accept]
    "accept_len",  # n-gram accepted length                     []
)
PUBLISH_FIELDS = ("confidence",)  # per-draft confidence          [num_draft]


class RelayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the relay holds. Rows 1..max_reqs belong to requests; row 0 is the padding row."""

    max_reqs: int
    max_batch: int
    token_dtype: str = "int32"
    pad_token_id: int = 0
    seq_len_dtype: str = "int32"
    seq_len_fill: int = 1
    topk_p: Optional[FieldSpec] = None
    topk_index: Optional[FieldSpec] = None
    hidden: Optional[FieldSpec] = None
    draft_probs: Optional[FieldSpec] = None
    sparse_topk: Optional[FieldSpec] = None
    accepted_tokens: Optional[FieldSpec] = None
    accept_len: Optional[FieldSpec] = None
    confidence: Optional[FieldSpec] = None
    # Device-side checks (poisoned rows, consume-once, bounds) for code that runs in capture.
    debug: bool = False

    def __post_init__(self) -> None:
        for name in ("max_reqs", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RelayConfig.{name} must be a positive int, got {value!r}")
        for name in ("token_dtype", "seq_len_dtype"):
            if getattr(self, name) not in INT_DTYPES:
                raise ValueError(
                    f"RelayConfig.{name} {getattr(self, name)!r} must be an integer dtype, "
                    f"one of {sorted(INT_DTYPES)}"
                )
        for name, dtype, what in (
            ("pad_token_id", self.token_dtype, "a valid token id"),
            ("seq_len_fill", self.seq_len_dtype, "the seq len padding rows report"),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"RelayConfig.{name} must be an int ({what}), got {value!r}")
            high = torch.iinfo(DTYPES[dtype]).max
            if not 0 <= value <= high:
                raise ValueError(
                    f"RelayConfig.{name} must be in [0, {high}] ({what}, stored as {dtype}), got {value}"
                )
        if not isinstance(self.debug, bool):
            raise ValueError(f"RelayConfig.debug must be True or False, got {self.debug!r}")
        for name in ("topk_index", "sparse_topk", "accepted_tokens", "accept_len"):
            spec = getattr(self, name)
            if spec is not None and spec.dtype not in INT_DTYPES:
                raise ValueError(
                    f"RelayConfig.{name}.dtype {spec.dtype!r} must be an integer dtype: it holds "
                    "indices or counts"
                )
        if (self.topk_p is None) != (self.topk_index is None):
            raise ValueError(
                "RelayConfig.topk_p and topk_index come together (EAGLE top-k): declare both or neither"
            )
        if self.topk_p is not None and self.topk_p.shape != self.topk_index.shape:
            raise ValueError(
                f"RelayConfig.topk_p shape {self.topk_p.shape} must equal topk_index shape "
                f"{self.topk_index.shape}"
            )
        if self.accept_len is not None and self.accept_len.shape != ():
            raise ValueError("RelayConfig.accept_len is one count per slot: use shape []")

    @property
    def rows(self) -> int:
        """Buffer rows: one per request slot plus the padding row 0."""
        return self.max_reqs + 1

    @property
    def debug_enabled(self) -> bool:
        """`debug`, or the GRAPHRELAY_DEBUG environment switch (see `env_flag`)."""
        return self.debug or env_flag("GRAPHRELAY_DEBUG")

    @property
    def token_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.token_dtype]

    @property
    def seq_len_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.seq_len_dtype]

    # ---- presets -------------------------------------------------------------------------

    @classmethod
    def plain(cls, max_reqs: int, max_batch: int, **overrides) -> "RelayConfig":
        """Plain decode: tokens and seq lens only."""
        return cls(max_reqs=max_reqs, max_batch=max_batch, **overrides)

    @classmethod
    def eagle(
        cls,
        max_reqs: int,
        max_batch: int,
        topk: int = 8,
        hidden_size: int = 4096,
        hidden_dtype: str = "bfloat16",
        **overrides,
    ) -> "RelayConfig":
        """EAGLE speculative decoding: top-k probabilities and indices plus hidden states."""
        return cls(
            max_reqs=max_reqs,
            max_batch=max_batch,
            topk_p=FieldSpec((topk,), "float32"),
            topk_index=FieldSpec((topk,), "int64"),
            hidden=FieldSpec((hidden_size,), hidden_dtype),
            **overrides,
        )

    # ---- loading ---------------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: bytes | str) -> "RelayConfig":
        return _decode(lambda: msgspec.json.decode(data, type=cls))

    @classmethod
    def from_toml(cls, data: bytes | str) -> "RelayConfig":
        return _decode(lambda: msgspec.toml.decode(data, type=cls))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RelayConfig":
        """Load from a `.json` or `.toml` file; any error names the file."""
        path = Path(path)
        decode = {".json": cls.from_json, ".toml": cls.from_toml}.get(path.suffix)
        if decode is None:
            raise ValueError(f"RelayConfig file {path} must end in .json or .toml")
        try:
            return decode(path.read_bytes())
        except OSError as exc:
            raise ValueError(f"cannot read RelayConfig file {path}: {exc.strerror}") from None
        except ValueError as exc:  # msgspec.DecodeError is a ValueError too
            raise ValueError(f"RelayConfig file {path}: {exc}") from None

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)


def _decode(decode):
    try:
        return decode()
    except msgspec.ValidationError as exc:
        # Our own __post_init__ ValueErrors surface through msgspec as ValidationError.
        raise ValueError(f"invalid RelayConfig: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed RelayConfig: {exc}") from None
