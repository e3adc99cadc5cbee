"""Three vox-ws replicas (real `vox-ws serve` processes, the tiny VoxCPM2) behind a real HAProxy
(deploy/haproxy.cfg, Debian's haproxy) with a real redis-server as the shared voice store: voices,
balance, a drain, a kill -9 and a Redis restart, as a client of the balancer sees them. The figures
it prints are those of docs/DEPLOY.md."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import RedisServer
from helpers import Balancer, free_port, tone_wav
from vox_ws.clients import v1 as vox

pytestmark = pytest.mark.replicas

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {"seed": 3, "max_len": 12}


def http_get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, {}


class Replica:
    def __init__(self, name: str, model: Path, redis_url: str, logs: Path) -> None:
        self.name, self.model, self.redis_url, self.logs = name, model, redis_url, logs
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log = open(self.logs / f"{self.name}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vox_ws", "serve", "--engine", "voxcpm", "--model", str(self.model),
             "--device", "cpu", "--port", str(self.port), "--max-batch", "16", "--drain-timeout", "60",
             "--voice-store", self.redis_url, "--trusted-proxies", "127.0.0.1",
             # What is tested here is voices and drains; each replica compiling its step in the
             # background would spend this 2-core machine's CPU on what tests/test_compiled.py covers.
             "--compile", "off"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited: {(self.logs / f'{self.name}.log').read_text()[-3000:]}")
            try:
                if http_get(self.port, "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready")

    def info(self) -> dict:
        return http_get(self.port, "/v1/info")[1]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(20)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    for tool in ("haproxy", "redis-server"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (scripts/test.sh installs Debian's)")
    logs = tmp_path_factory.mktemp("replicas")
    redis = RedisServer(str(tmp_path_factory.mktemp("redis-data")))
    replicas = [Replica(f"r{i}", tiny_model, redis.url, logs) for i in (1, 2, 3)]
    for replica in replicas:
        replica.start()
    try:
        for replica in replicas:
            replica.wait_ready()
        balancer = Balancer(replicas, logs)
        for replica in replicas:                    # every replica checked up
            asyncio.run(balancer.wait_until_seen(replica.name, "UP"))
        yield {"redis": redis, "replicas": replicas, "balancer": balancer}
        balancer.stop()
    finally:
        for replica in replicas:
            replica.stop()
        redis.stop()


def streams_open(replicas: list[Replica]) -> list[int]:
    return [r.info()["streams_open"] if r.proc.poll() is None else 0 for r in replicas]


async def test_a_voice_registered_through_the_balancer_speaks_on_every_replica(cluster):
    balancer, replicas = cluster["balancer"], cluster["replicas"]
    async with vox.connect(balancer.url) as c:
        voice = await c.register_voice(tone_wav(1.0, pitch=170), "A voice for every replica.")
    audio = []
    for replica in replicas:                       # each replica directly: it builds the voice
        pcm = await vox.speak(f"ws://127.0.0.1:{replica.port}/v1/stream", "Everywhere.", voice=voice,
                              format="f32", options=OPTIONS, retries=0)
        audio.append(np.frombuffer(pcm, "<f4"))
    assert audio[0].size > 0
    for other in audio[1:]:
        np.testing.assert_allclose(other, audio[0], atol=1e-4)


async def test_through_the_balancer_each_client_owns_its_own_voices(cluster):
    """Every client through HAProxy was one address (HAProxy's) and so one owner: one deleted
    what another registered. With the PROXY header each is itself."""
    balancer = cluster["balancer"]
    base = f"http://127.0.0.1:{balancer.port}"
    mine = httpx.AsyncClient(base_url=base, transport=httpx.AsyncHTTPTransport(local_address="127.0.0.21"))
    theirs = httpx.AsyncClient(base_url=base, transport=httpx.AsyncHTTPTransport(local_address="127.0.0.22"))
    async with mine, theirs:
        created = await mine.post("/v1/voices", content=tone_wav(1.0, pitch=150), headers={"content-type": "audio/wav"})
        assert created.status_code == 201, created.text
        voice = created.json()["voice"]
        forged = await theirs.delete(f"/v1/voices/{voice}", headers={"X-Forwarded-For": "127.0.0.21"})
        assert forged.status_code == 404, forged.text
        deleted = await mine.delete(f"/v1/voices/{voice}")
        assert deleted.status_code == 200, deleted.text


async def test_thirty_streams_spread_evenly(cluster):
    balancer, replicas = cluster["balancer"], cluster["replicas"]
    clients = [await vox.open_client(balancer.url) for _ in range(30)]
    try:
        streams = [await c.open_stream() for c in clients]          # idle input streams: held open
        spread = streams_open(replicas)
        print(f"\n30 streams over 3 replicas: {spread}")
        assert sum(spread) == 30 and max(spread) - min(spread) <= 4 and all(abs(n - 10) <= 2 for n in spread)
        for stream in streams:
            await stream.cancel()
    finally:
        for c in clients:
            await c.close()


async def test_sigterm_drains_one_replica_and_nothing_is_lost(cluster):
    balancer, replicas = cluster["balancer"], cluster["replicas"]
    victim = replicas[0]
    # Six streams in flight over the three replicas, each some 2 s of generation.
    clients = [await vox.open_client(balancer.url) for _ in range(6)]
    streams = [await c.start_stream("Draining is orderly.", format="f32", options=OPTIONS) for c in clients]
    on_victim = streams_open([victim])[0]
    assert on_victim >= 1
    victim.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    print(f"\nSIGTERM to a replica with {on_victim} of 6 streams in flight")
    # Clients keep arriving through the balancer; one that lands on the draining replica is
    # closed 1012 and the bundled client connects again, elsewhere.
    newcomers = await asyncio.gather(*(vox.speak(balancer.url, "A new client.", format="f32", options=OPTIONS,
                                                 retries=6, retry_wait=0.1) for _ in range(6)))
    assert all(len(pcm) > 0 for pcm in newcomers)
    # The streams in flight, on the draining replica too, all finish.
    for stream in streams:
        assert len(await stream.read_all()) > 0 and stream.ended["reason"] == "max_len"
    for c in clients:
        await c.close()
    assert victim.proc.wait(30) == 0
    # Once HAProxy has seen it, new sessions go only to the others.
    await balancer.wait_until_seen(victim.name, "DOWN")
    print(f"drain: all 6 streams in flight finished, 6 of 6 new clients spoken, the replica exited 0 "
          f"{time.monotonic() - signalled:.2f} s after SIGTERM")
    others = replicas[1:]
    before = [r.info()["steps_total"] for r in others]
    await vox.speak(balancer.url, "Only the others now.", format="f32", options=OPTIONS, retries=0)
    assert [r.info()["steps_total"] for r in others] != before
    victim.start()
    victim.wait_ready()
    await balancer.wait_until_seen(victim.name, "UP")


async def test_kill_9_loses_only_that_replicas_streams_and_clients_reconnect(cluster):
    balancer, replicas = cluster["balancer"], cluster["replicas"]
    victim = replicas[1]
    clients = [await vox.open_client(balancer.url) for _ in range(6)]
    streams = [await c.start_stream("Killed mid stream? " * 3, format="f32", options={"seed": 1, "max_len": 40})
               for c in clients]
    on_victim = streams_open([victim])[0]
    assert on_victim >= 1
    victim.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    async def newcomer() -> float:
        """A client arriving right after the kill: seconds from the kill to its first audio (HAProxy
        redispatches a connection the dead replica refuses; its health check takes it out)."""
        async with vox.connect(balancer.url, retries=6, retry_wait=0.1) as c:
            stream = await c.start_stream("After the kill.", format="f32", options=OPTIONS)
            async for _ in stream:
                return time.monotonic() - killed
        raise AssertionError("no audio")

    async def outcome(stream) -> str:
        try:
            await stream.read_all()
            return "finished"
        except vox.ConnectionLost as err:
            assert err.retryable and err.close_code in vox.RECONNECT_CLOSE_CODES
            return "lost"

    served_after, *outcomes = await asyncio.gather(newcomer(), *(outcome(s) for s in streams))
    lost = outcomes.count("lost")
    assert lost == on_victim and outcomes.count("finished") == 6 - on_victim
    for c in clients:
        await c.close()
    # The bundled client's retry: the lost utterances are spoken again, elsewhere.
    again = await asyncio.gather(*(vox.speak(balancer.url, "Killed mid stream? " * 3, format="f32",
                                             options={"seed": 1, "max_len": 40}, retries=3) for _ in range(lost)))
    assert all(len(pcm) > 0 for pcm in again)
    print(f"\nkill -9: {lost} of 6 streams lost (those on the killed replica), a new client's first audio "
          f"{served_after:.2f} s after the kill")
    victim.start()
    victim.wait_ready()
    await balancer.wait_until_seen(victim.name, "UP")


async def test_voices_survive_a_redis_restart(cluster):
    balancer, redis = cluster["balancer"], cluster["redis"]
    async with vox.connect(balancer.url) as c:
        voice = await c.register_voice(tone_wav(1.0, pitch=260), "Kept across a restart.")
    redis.restart()
    for replica in cluster["replicas"]:
        pcm = await vox.speak(f"ws://127.0.0.1:{replica.port}/v1/stream", "After the restart.", voice=voice,
                              format="f32", options=OPTIONS, retries=2)
        assert len(pcm) > 0
