"""graphrelay: carry per-request values across LLM decode iterations on the GPU, capturable."""

from graphrelay.config import FieldSpec, RelayConfig
from graphrelay.debug import RelayDebugError
from graphrelay.fields import Field, RelayPayload, Resolved
from graphrelay.mirror import HostMirror, MirrorOverrun, MirrorRead
from graphrelay.relay import Relay
from graphrelay.runtime import Event, PinnedRing, Stream, cuda_available

__all__ = [
    "Event",
    "Field",
    "FieldSpec",
    "HostMirror",
    "MirrorOverrun",
    "MirrorRead",
    "PinnedRing",
    "Relay",
    "RelayConfig",
    "RelayDebugError",
    "RelayPayload",
    "Resolved",
    "Stream",
    "cuda_available",
]
