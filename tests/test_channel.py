"""The two ends of the boundary's socket (`engine_process/channel.py`): the engine's, read and
written by threads, and the server's, read by the event loop into buffers of each frame's own
size, however the bytes arrive; a server that stops reading holds the engine's writer, not its
memory."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np

from conftest import WAIT_TIMEOUT
from vox_ws.engine_process.channel import BlockingChannel, ChannelProtocol
from vox_ws.engine_process.messages import AUDIO_DTYPE, Cancel, Row, Step, Submit, frame


def _step(rows: int, samples: int = 480) -> Step:
    audio = np.arange(rows * samples, dtype=AUDIO_DTYPE)
    return Step(rows=tuple(Row(i, i * samples, samples) for i in range(rows)), step_rows=rows,
                payload=memoryview(audio).cast("B"))


class Fed:
    """A ChannelProtocol driven by hand, the way an event loop drives a BufferedProtocol."""

    def __init__(self) -> None:
        self.messages: list = []
        self.closed: list = []
        self.protocol = ChannelProtocol(self.messages.append, self.closed.append)

    def feed(self, data: bytes, piece: int) -> None:
        at = 0
        while at < len(data):
            buffer = self.protocol.get_buffer(-1)
            n = min(piece, len(buffer), len(data) - at)
            buffer[:n] = data[at:at + n]
            self.protocol.buffer_updated(n)
            at += n


def test_the_server_end_reads_frames_however_the_bytes_arrive():
    messages = [Submit(1, "One."), _step(3), Cancel(1), _step(1, 4800), Submit(2, "Two.")]
    wire = b"".join(bytes(piece) for message in messages for piece in frame(message))
    for piece in (1, 7, 4096, len(wire)):
        fed = Fed()
        fed.feed(wire, piece)
        assert [type(m) for m in fed.messages] == [Submit, Step, Cancel, Step, Submit]
        steps = [m for m in fed.messages if isinstance(m, Step)]
        assert np.array_equal(steps[0].audio(steps[0].rows[2]), np.arange(960, 1440, dtype=AUDIO_DTYPE))
        assert len(steps[1].audio(steps[1].rows[0])) == 4800
        assert fed.closed == []


def test_a_frame_that_is_no_message_ends_the_channel_saying_why():
    class Transport:
        closed = False

        def close(self) -> None:
            self.closed = True

    fed = Fed()
    fed.protocol.transport = Transport()
    fed.feed(b"\x00\x00\x00\x02\x00\x00\x00\x00\xc1\xc1", 3)
    assert fed.messages == [] and fed.protocol.transport.closed
    fed.protocol.connection_lost(None)
    assert len(fed.closed) == 1 and "no message" in str(fed.closed[0])
    good = Fed()                                         # and a good channel beside it reads on
    good.feed(b"".join(bytes(p) for p in frame(Cancel(5))), 2)
    assert good.messages == [Cancel(5)]


def test_the_engine_end_sends_and_receives_in_order_over_a_socket():
    ours, theirs = socket.socketpair()
    engine, server = BlockingChannel(ours), BlockingChannel(theirs)
    try:
        for n in range(20):
            engine.send(_step(2, 100 + n))
        received = [server.receive() for _ in range(20)]
        assert [m.rows[0].length for m in received] == [100 + n for n in range(20)]
        server.send(Cancel(9))
        assert engine.receive() == Cancel(9)
        server.close()
        assert engine.receive() is None                  # the other end has gone
    finally:
        engine.close()


def test_a_server_that_reads_nothing_holds_the_engines_writer_not_its_memory():
    """With every byte it may queue waiting, the engine's next `send` waits (the engine loop's
    next turn with it) until the server reads: what waits stays within the bound."""
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    bound = 64 * 1024
    engine = BlockingChannel(ours, max_queued_bytes=bound)
    big = _step(1, 8000)                                 # 32 kB a frame
    sent = []

    def send_many() -> None:
        for n in range(40):
            sent.append(n)
            engine.send(big)

    sender = threading.Thread(target=send_many, daemon=True)
    sender.start()
    sender.join(1.0)               # it cannot end: nothing reads (the second only spares the wait)
    assert sender.is_alive() and len(sent) < 40
    assert engine._queued_bytes <= bound
    server = BlockingChannel(theirs)
    for _ in range(40):
        assert server.receive() is not None              # reading lets every send through
    sender.join(WAIT_TIMEOUT)
    assert not sender.is_alive() and len(sent) == 40
    engine.close()
    server.close()


async def test_the_event_loops_end_reads_a_socket_without_a_thread():
    ours, theirs = socket.socketpair()
    engine = BlockingChannel(ours)
    got: list = []
    ended = asyncio.get_running_loop().create_future()
    transport, protocol = await asyncio.get_running_loop().connect_accepted_socket(
        lambda: ChannelProtocol(got.append, ended.set_result), theirs)
    for n in range(5):
        engine.send(_step(4, 960))
    protocol.send(Submit(3, "Back."))
    assert engine.receive() == Submit(3, "Back.")
    assert engine.flush(WAIT_TIMEOUT)                    # what is queued is written, then the end
    engine.close()
    assert await asyncio.wait_for(ended, WAIT_TIMEOUT) is None
    assert len(got) == 5 and all(len(m.rows) == 4 for m in got)
    transport.close()
