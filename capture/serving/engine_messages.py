"""What the HTTP process and the engine process say to each other, one msgpack frame each
(`frames`). Each side sends at most one message a turn of its own loop: the HTTP process a
`Submit` or `Abort` as handlers ask, the engine one `Results` per serving-loop turn with
everything that turn produced (tokens, finishes, admissions), so a frame's fixed cost is paid
per turn, not per stream."""

from __future__ import annotations

from typing import Optional, Union

import msgspec

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.serving.engine_handle import EngineInfo
from graphrelay.capture.serving.loop import RequestOutput
from graphrelay.capture.serving.loop_stats import LoopStats
from graphrelay.capture.serving.workloads import Request


# ---- to the engine ---------------------------------------------------------------------------

class Submit(msgspec.Struct, tag=True, array_like=True):
    request: Request


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Hello(msgspec.Struct, tag=True, array_like=True):
    """An API server's first message: its process id, so the engine can report the whole
    server's resident memory (every API server's and its own) in `Results.rss_bytes`."""

    pid: int


class Close(msgspec.Struct, tag=True, array_like=True):
    """Admit nothing more; finish what is held, send `Finished`, exit."""


# ---- to the HTTP process ---------------------------------------------------------------------

class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo


class Tokens(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    tokens: list[int]
    logprobs: Optional[list[TokenLogprobs]]


class Finish(msgspec.Struct, tag=True, array_like=True):
    output: RequestOutput


class Rejection(msgspec.Struct, array_like=True):
    request_id: str
    message: str  # begins with the field it is about (`engine_handle.Rejected`)


class Results(msgspec.Struct, tag=True, array_like=True):
    events: list[Union[Tokens, Finish]]  # in the order the loop produced them
    admitted: list[str]  # request ids taken into the loop's queue since the last Results
    rejected: list[Rejection]  # sampling controls the engine refused
    occupancy: dict[str, int]  # the loop's slot counts (`ServingLoop.occupancy`)
    rss_bytes: Optional[int]  # the whole server's resident memory (engine and API servers); None: not measured this time


class Finished(msgspec.Struct, tag=True, array_like=True):
    stats: LoopStats


class Failed(msgspec.Struct, tag=True, array_like=True):
    message: str


ToEngine = Union[Hello, Submit, Abort, Close]
ToServer = Union[Ready, Results, Finished, Failed]
encode = msgspec.msgpack.Encoder().encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_to_server = msgspec.msgpack.Decoder(ToServer).decode
