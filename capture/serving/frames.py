"""Length-prefixed frames over a one-way OS pipe: how the HTTP process and the engine process
talk (`engine_process`, `engine_channel`).

A frame is a 4-byte little-endian length and that many bytes (one msgpack message). Readers
never block: `FrameReader.read` takes whatever has arrived, cuts it into whole frames and keeps
the rest for next time, so neither process ever waits on the other in the middle of a message.
The HTTP process's writer never blocks either (`FrameWriter` given its event loop: what the
pipe cannot take now waits in a buffer that the loop flushes when the pipe is writable). The
engine's writer blocks while the pipe is full, which slows the engine to what the HTTP side
can take instead of buffering without bound; it cannot deadlock, since the side it waits on
never blocks.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import struct
from typing import Optional

HEADER = struct.Struct("<I")
PIPE_BYTES = 1 << 20  # asked of the kernel per pipe: a burst of results fits without a wait
_READ_CHUNK = 1 << 20


def widen(fd: int) -> None:
    """Ask for a PIPE_BYTES pipe buffer (Linux; elsewhere, or above the system's limit, the
    default stays: only a burst waits sooner)."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ"), PIPE_BYTES)
    except (AttributeError, OSError):
        pass


class FrameReader:
    """The read end of a pipe, non-blocking. `closed` once the writer has gone and every whole
    frame before that has been returned."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self.fd = fd
        self.closed = False
        self._buffer = bytearray()

    def read(self) -> list[bytes]:
        """Every whole frame that has arrived since the last call (maybe none)."""
        while True:
            try:
                chunk = os.read(self.fd, _READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                self.closed = True  # a partial frame left behind was cut off by the writer's death
                break
            self._buffer += chunk
            if len(chunk) < _READ_CHUNK:
                break
        frames, at, buffer = [], 0, self._buffer
        while len(buffer) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, at)
            end = at + HEADER.size + size
            if end > len(buffer):
                break
            frames.append(bytes(buffer[at + HEADER.size:end]))
            at = end
        del buffer[:at]
        return frames


class FrameWriter:
    """The write end of a pipe. Without `events`, `send` blocks until the frame is written;
    with an event loop it never blocks, and must then be used from that loop only."""

    def __init__(self, fd: int, events: Optional[asyncio.AbstractEventLoop] = None):
        self.fd = fd
        self._events = events
        self._pending = bytearray()  # the event loop's unsent bytes, oldest first
        self.broken = False  # the reader has gone: later frames are dropped
        if events is not None:
            os.set_blocking(fd, False)

    def send(self, data: bytes) -> None:
        frame = HEADER.pack(len(data)) + data
        if self.broken:
            raise BrokenPipeError("the other process has closed its end of the pipe")
        if self._events is None:
            view = memoryview(frame)
            while view:
                view = view[os.write(self.fd, view):]
            return
        if self._pending:
            self._pending += frame  # behind what is already waiting, to keep frames whole and in order
            return
        written = self._write(frame)
        if written < len(frame):
            self._pending += frame[written:]
            self._events.add_writer(self.fd, self._flush)

    def _write(self, data) -> int:
        try:
            return os.write(self.fd, data)
        except BlockingIOError:
            return 0
        except BrokenPipeError:
            self.broken = True
            self._pending.clear()
            return len(data)

    def _flush(self) -> None:
        del self._pending[:self._write(self._pending)]
        if not self._pending:
            self._events.remove_writer(self.fd)
