"""The frames the HTTP and engine processes exchange (`capture.serving.frames`): every frame
arrives whole and in order whatever the pipe cuts it into, the event loop's writer never
blocks on a full pipe, and a writer's death reads as a clean end."""

from __future__ import annotations

import asyncio
import os
import random
import threading

import pytest

from graphrelay.capture.serving.frames import HEADER, FrameReader, FrameWriter

HANG_S = 120  # only bounds a hang


def _read_all(reader: FrameReader, count: int) -> list[bytes]:
    import select
    got: list[bytes] = []
    while len(got) < count and not reader.closed:
        ready, _, _ = select.select([reader.fd], [], [], HANG_S)
        assert ready, f"no frame within {HANG_S} s after {len(got)} of {count}"
        got += reader.read()
    return got


def test_frames_larger_and_smaller_than_the_pipe_arrive_whole_and_in_order():
    rng = random.Random(3)
    frames = [rng.randbytes(n) for n in [0, 1, 3, 4, 5, 70_000, 0, 2_500_000] + [rng.randrange(300) for _ in range(200)]]
    read_fd, write_fd = os.pipe()
    writer = FrameWriter(write_fd)  # blocking: runs beside the reader
    thread = threading.Thread(target=lambda: [writer.send(f) for f in frames], daemon=True)
    thread.start()
    got = _read_all(FrameReader(read_fd), len(frames))
    thread.join(HANG_S)
    assert got == frames
    os.close(read_fd)
    os.close(write_fd)


def test_a_frame_cut_off_by_the_writers_death_is_dropped_and_the_reader_is_closed():
    read_fd, write_fd = os.pipe()
    FrameWriter(write_fd).send(b"whole")
    os.write(write_fd, HEADER.pack(10) + b"part")  # the writer died mid-frame
    os.close(write_fd)
    reader = FrameReader(read_fd)
    frames = reader.read()
    frames += reader.read()  # the end may come with the bytes or with the next read
    assert frames == [b"whole"] and reader.closed
    assert reader.read() == []
    os.close(read_fd)


def test_the_event_loops_writer_never_blocks_and_flushes_when_the_pipe_drains():
    read_fd, write_fd = os.pipe()
    frames = [bytes([i % 251]) * 40_000 for i in range(60)]  # 2.4 MB: far beyond the pipe's buffer

    async def main():
        writer = FrameWriter(write_fd, asyncio.get_running_loop())
        for frame in frames:
            writer.send(frame)  # would block here if the writer blocked: nobody reads yet
        assert writer._pending, "the pipe took 2.4 MB at once: the test no longer fills it"
        reader = FrameReader(read_fd)
        got: list[bytes] = []
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def take():
            got.extend(reader.read())
            if len(got) == len(frames) and not done.done():
                done.set_result(None)
        loop.add_reader(read_fd, take)
        await asyncio.wait_for(done, HANG_S)
        loop.remove_reader(read_fd)
        assert not writer._pending
        return got

    assert asyncio.run(main()) == frames
    os.close(read_fd)
    os.close(write_fd)


def test_the_event_loops_writer_reports_a_reader_that_is_gone():
    read_fd, write_fd = os.pipe()
    os.close(read_fd)

    async def main():
        writer = FrameWriter(write_fd, asyncio.get_running_loop())
        writer.send(b"lost")  # the first write finds the pipe broken: dropped, not raised mid-handler
        assert writer.broken
        with pytest.raises(BrokenPipeError):
            writer.send(b"next")

    asyncio.run(main())
    os.close(write_fd)
