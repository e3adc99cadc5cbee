"""What a balancer and an autoscaler see: /v1/load, readiness while full, the close codes for full
and draining, and the bundled client connecting again ("elsewhere") on them."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from conftest import RunningServer, connect_client, make_config, wait_until
from vox_ws.clients import v1 as vox
from vox_ws.testing.tone import ToneEngine


def slow_tone() -> ToneEngine:
    # 80 ms of audio per 40 ms step: a text of 60 characters speaks for 3 s over 1.5 s.
    return ToneEngine(chunk_s=0.08, step_interval_s=0.04)


async def test_load_reports_slots_queue_step_time_and_one_figure(start_server):
    server = start_server(slow_tone(), slots=2)
    status, idle = server.get("/v1/load")
    assert status == 200
    assert idle == {"ready": True, "draining": False, "slots": 2, "step_rows": 2, "active": 0, "queued": 0,
                    "free_slots": 2, "mean_step_ms": 0.0, "load": 0.0, "sessions": 0}
    async with connect_client(server) as c:
        for sid in ("a", "b", "c"):
            await c.send({"type": "start", "id": sid, "text": "x" * 200})
        await wait_until(lambda: server.get("/v1/load")[1]["queued"] == 1)
        await wait_until(lambda: server.get("/v1/load")[1]["mean_step_ms"] > 20)
        busy = server.get("/v1/load")[1]
        assert (busy["active"], busy["queued"], busy["free_slots"], busy["load"], busy["sessions"]) == (2, 1, 0, 1.0, 1)
        assert busy["mean_step_ms"] > 20                 # the tone engine steps at a 40 ms pace, never faster
        for sid in ("a", "b", "c"):
            await c.send({"type": "cancel", "id": sid})
        await wait_until(lambda: server.get("/v1/load")[1]["load"] == 0.0)


async def test_full_server_turns_unready_and_sends_new_connections_elsewhere(start_server):
    server = start_server(slow_tone(), slots=1, unready_when_full=True)
    assert server.get("/readyz")[0] == 200
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "long", "text": "x" * 60})
        await c.recv_where(lambda m: m["type"] == "chunk")
        assert server.get("/readyz") == (503, {"status": "full"})
        # A new connection is closed 1013 before its hello ...
        with pytest.raises(vox.ConnectionLost) as lost:
            await vox.open_client(server.url)
        assert lost.value.close_code == 1013 and lost.value.retryable
        # ... and the bundled client connects again until it is let in (the stream ends in 1.5 s).
        started = time.monotonic()
        async with vox.connect(server.url, retries=6, retry_wait=0.1) as again:
            assert again.hello.protocol == 1
            assert time.monotonic() - started > 0.3
        result = await c.collect("long")
        assert result.end["reason"] == "done"
    assert server.get("/readyz")[0] == 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_draining_server_closes_new_connections_1012(start_server):
    server = start_server(slow_tone(), drain_timeout=60.0)   # a drain ends when its streams do
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "inflight", "text": "x" * 40})
        await c.recv_where(lambda m: m["type"] == "chunk")
        asyncio.run_coroutine_threadsafe(_drain(server), server.loop)
        await wait_until(lambda: server.server.draining)
        assert server.get("/readyz")[0] == 503
        assert server.get("/v1/load")[1]["draining"] is True
        with pytest.raises(vox.ConnectionLost) as lost:
            await vox.open_client(server.url)
        assert lost.value.close_code == 1012 and lost.value.retryable
        result = await c.collect("inflight")               # the stream in flight finishes
        assert result.end["reason"] == "done"


async def _drain(server: RunningServer) -> None:
    server.server.request_shutdown()


async def test_speak_starts_over_on_another_server_when_its_server_goes(start_server):
    """The server goes away mid-stream; `vox_ws.clients.v1.speak` connects again (here the same
    address, where a new server comes up: behind a balancer, another replica) and speaks."""
    port = free_port()
    first = start_server(slow_tone(), port=port)
    text = "x" * 60
    replaced: list[RunningServer] = []

    def replace_server() -> None:
        # Once the stream is under way (it speaks for 1.5 s, paced), the server goes.
        while not (first.devices.stats()["active"] and first.devices.stats()["steps_total"] >= 2):
            time.sleep(0.005)
        first.stop()                        # no drain: the stream in flight ends `going_away`
        replaced.append(RunningServer(slow_tone(), make_config(port=port)))
        replaced[0].wait_ready()

    swapper = threading.Thread(target=replace_server)
    started = time.monotonic()
    swapper.start()
    try:
        audio = await vox.speak(first.url, text, retries=8, retry_wait=0.2, format="s16")
        swapper.join(30)
        # The first server went mid-stream, and the replacement spoke the whole text again.
        assert replaced and not first.server.running
        assert replaced[0].devices.stats()["steps_total"] >= 3.0 / 0.08
    finally:
        swapper.join(30)
        for running in replaced:
            running.stop()
    assert len(audio) / 2 / 24000 == pytest.approx(3.0, abs=0.1)      # the whole text, once
    assert time.monotonic() - started > 1.0
