"""graphrelay: carry per-request values across LLM decode iterations on the GPU, capturable."""

from graphrelay.config import FieldSpec, RelayConfig
from graphrelay.debug import RelayDebugError
from graphrelay.fields import Field, RelayPayload, Resolved
from graphrelay.relay import Relay

__all__ = ["Field", "FieldSpec", "Relay", "RelayConfig", "RelayDebugError", "RelayPayload", "Resolved"]
