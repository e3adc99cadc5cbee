"""Fuzzing the frame decoder and message handling: every input gets a typed error (or a
documented close), the server never crashes, and a good request afterwards works."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_good_stream, connect_client
from vox_ws.engines import option_vocabulary
from vox_ws.engines.piper import PiperEngine
from vox_ws.transports import protocol as p

LIMITS = p.Limits(max_frame_bytes=4096, max_text_chars=200)
OPTIONS = option_vocabulary()
TYPES = ["start", "chunk", "end", "flush", "cancel", "voice", "voice_delete", "lora", "nope", "", "START"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=20)
field_values = {
    "id": st.one_of(st.text(max_size=150), values),
    "text": st.one_of(st.text(max_size=250), values),
    "voice": st.one_of(st.sampled_from(["joe", "v_x"]), values),
    "format": st.one_of(st.sampled_from(["f32", "s16", "mulaw"]), values),
    "sample_rate": st.one_of(st.integers(0, 100_000), values),
    "options": st.one_of(st.dictionaries(st.sampled_from(sorted(OPTIONS) + ["x"]), values, max_size=4),
                         values),
    "stream_input": values,
    "audio": st.one_of(st.binary(max_size=100), values),
    "mode": st.one_of(st.sampled_from(p.VOICE_MODES), values),
    "transcript": values,
    "op": st.one_of(st.sampled_from(p.LORA_OPS), values),
    "name": values,
    "lora": st.one_of(st.sampled_from(["bright", "", "../x"]), values),
}
messages = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(TYPES), values)},
    optional={k: v for k, v in field_values.items()},
)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


frames = st.one_of(
    st.binary(max_size=300),                                    # garbage
    messages.map(pack),                                         # plausible messages
    st.builds(lambda m, cut: pack(m)[:cut], messages, st.integers(0, 50)),   # truncated
    st.builds(lambda m, b: bytes(x ^ b if i % 7 == 3 else x for i, x in enumerate(pack(m))), messages,
              st.integers(1, 255)),                             # bit-flipped
    values.map(pack),                                           # any msgpack value
    st.builds(lambda depth: b"\x91" * depth + b"\xc0", st.integers(1, 3000)),   # deep nesting
    st.text(max_size=50),                                       # text frames
)


def decode_and_parse(frame):
    return p.parse_message(p.decode_frame(frame, LIMITS), LIMITS, OPTIONS)


@pytest.mark.slow
@settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames)
def test_decoder_raises_only_protocol_errors(frame):
    try:
        message = decode_and_parse(frame)
    except p.ProtocolError as err:
        assert err.code in p.ERROR_CODES
        assert err.message
        assert err.stream_id is None or isinstance(err.stream_id, str)
        return
    assert isinstance(message, (p.Start, p.Chunk, p.End, p.Flush, p.Cancel, p.Voice, p.VoiceDelete, p.Lora))


# ------------------------------------------------------------------ against a live server


class LiveClient:
    """A connection driven from synchronous hypothesis tests, on its own event loop."""

    def __init__(self, server):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = server
        self.client = None
        self.cases = 0
        self.run(self._open())

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self):
        self._cm = connect_client(self.server)
        self.client = await self._cm.__aenter__()

    async def exchange(self, frame):
        """Send one frame, then a sentinel; every reply before the sentinel's must be well formed.
        The sentinel is a request that succeeds (deleting a voice this client does not own
        answers `deleted: false`), so the refused frames never add up to the 50 in a row that
        close a connection."""
        c = self.client
        self.cases += 1
        sentinel = f"sentinel-{self.cases}"
        await c.send(frame)
        await c.send({"type": "voice_delete", "id": sentinel, "voice": "v_nobody"})
        while True:
            m = await c.recv(timeout=30)
            assert isinstance(m, dict) and m["type"] in ("error", "start", "chunk", "end", "voice", "lora",
                                                         "voice_delete"), m
            if m["type"] == "voice_delete" and m.get("id") == sentinel:
                assert m["deleted"] is False
                return
            if m["type"] == "error":
                assert m["code"] in p.ERROR_CODES and isinstance(m["retryable"], bool) and m["message"]
                assert m.get("id") != sentinel, m
            if m["type"] == "start":
                # A random but valid request: stop it (and the connection stays usable).
                await c.send({"type": "cancel", "id": m["id"]})

    def close(self):
        self.run(self._cm.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def fuzz_server(start_server):
    # A rate limit high enough for a fuzzer; texts short so accidental streams end quickly.
    return start_server(PiperEngine(), max_messages_per_s=100_000.0, max_text_chars=200, max_streams=64,
                        max_frame_bytes=4096)


@pytest.fixture(scope="module")
def live(fuzz_server):
    client = LiveClient(fuzz_server)
    yield client
    client.close()


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(frame=frames)
def test_live_server_answers_every_frame_with_a_typed_reply(live, frame):
    if isinstance(frame, str) or len(frame) <= 4096 * 4:
        live.run(live.exchange(frame))


@pytest.mark.slow                   # the second half of the live fuzzing above
async def test_server_is_healthy_after_fuzzing(fuzz_server, live):
    assert live.cases >= 1000
    assert fuzz_server.devices.status == "ready"
    assert fuzz_server.get("/healthz")[0] == 200
    async with connect_client(fuzz_server) as c:
        assert_good_stream(await c.speak("Fuzzing is over.", "after"))
