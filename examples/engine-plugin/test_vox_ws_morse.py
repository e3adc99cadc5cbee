"""The Morse engine's tests: its timing alone, then served by a real vox-ws server on loopback and
heard by vox-ws's own v1 client (the engine on a thread of the test's process, behind the same
messages as in an engine process of its own)."""

import asyncio

import numpy as np
import pytest
from vox_ws_morse import MorseEngine, keying

from vox_ws.clients.v1 import VoxError, bytes_to_pcm, connect
from vox_ws.config import ServerConfig
from vox_ws.server import VoxServer


def test_the_keying_follows_the_code():
    on, words = keying("Hi!")                        # H ....  I ..  ! -.-.--
    dits_h, gap, dits_i = [1, 0, 1, 0, 1, 0, 1], [0, 0, 0], [1, 0, 1]
    bang = [1, 1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    assert on.tolist() == dits_h + gap + dits_i + gap + bang + [0] * 7
    assert words == [("Hi!", 0, len(on) - 7)]


@pytest.fixture
async def server():
    server = VoxServer(ServerConfig(port=0), MorseEngine(pitch=500.0))
    await server.start()
    await asyncio.to_thread(server.devices.ready_event.wait, 60)
    yield server
    await server.shutdown()


async def test_a_stream_is_sent_in_morse_code_and_a_text_without_any_is_refused(server):
    async with connect(f"ws://127.0.0.1:{server.port}/v1/stream") as client:
        stream = await client.start_stream("E", format="f32", options={"wpm": 20})
        pcm = bytes_to_pcm(await stream.read_all(), "f32")
        with pytest.raises(VoxError, match="nothing in this text can be sent"):
            await (await client.start_stream("###")).read_all()
    dot = 1440                                       # 1.2 / 20 s at 24 kHz
    assert len(pcm) == 8 * dot                       # a dot, then a word's gap
    assert np.sqrt(np.mean(pcm[:dot] ** 2)) > 0.2 and not np.any(pcm[dot:])
