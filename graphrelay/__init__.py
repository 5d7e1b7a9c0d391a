"""graphrelay: carry per-request values across LLM decode iterations on the GPU, capturable."""

from graphrelay.config import FieldSpec, RelayConfig

__all__ = ["FieldSpec", "RelayConfig"]
