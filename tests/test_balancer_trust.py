"""One `vox-ws serve` replica (Piper, every limit at its default, `--trusted-proxies` HAProxy's
address) behind a real HAProxy running deploy/haproxy.cfg, which sends the PROXY protocol (v2)
to it: every client is counted as itself, not as the balancer. Without that, 40 clients through
the balancer were refused at the 33rd ("too many connections from your address"), and one
client's refusals made the replica close HAProxy's health checks at accept: the replica went
DOWN and a bystander got 503."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from attackers import attacker_socket, read_until_closed, speech_headers
from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, start_serve
from helpers import Balancer, v2

pytestmark = pytest.mark.replicas

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 40
ABUSER, BYSTANDER = "127.0.0.60", "127.0.0.70"
IN_FLIGHT = 32                     # --max-connections-per-address's default: HTTP requests in flight too


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed (scripts/test.sh installs Debian's)")
    logs = tmp_path_factory.mktemp("balancer-trust")
    proc, port = start_serve([sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0",
                              "--voice-store", "memory", "--trusted-proxies", "127.0.0.1"],
                             logs / "replica.log", cwd=ROOT)
    balancer = None
    try:
        balancer = Balancer([SimpleNamespace(name="r1", port=port)], logs)
        asyncio.run(balancer.wait_until_seen("r1", "UP"))
        yield SimpleNamespace(balancer=balancer, port=port, proc=proc,
                              http=f"http://127.0.0.1:{balancer.port}", url=balancer.url)
    finally:
        if balancer is not None:
            balancer.stop()
        proc.terminate()
        proc.wait(30)


async def test_forty_clients_through_the_balancer_are_all_served(balanced):
    async def client(number: int, opened: asyncio.Barrier) -> None:
        async with connect_client(balanced, local_addr=(f"127.0.0.{10 + number}", 0)) as c:
            await opened.wait()                           # all 40 sessions open at once
            assert_good_stream(await c.speak("Served.", f"s{number}"), min_seconds=0.2)

    opened = asyncio.Barrier(CLIENTS)
    await asyncio.gather(*(client(n, opened) for n in range(CLIENTS)))
    assert balanced.balancer.states() == {"r1": "UP"}


async def wait_until_true(check) -> None:
    """Until the coroutine `check()` is true (WAIT_TIMEOUT at the most)."""
    deadline = asyncio.get_running_loop().time() + WAIT_TIMEOUT
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "never true"
        await asyncio.sleep(0.01)


def chkfail(balancer: Balancer) -> int:
    """HAProxy's count of failed health checks of r1."""
    return int(next(row for row in balancer.stats() if row["svname"] == "r1")["chkfail"] or 0)


async def test_a_client_past_its_budget_is_refused_alone_and_the_replica_stays_up(balanced):
    balancer = balanced.balancer
    failed_before = chkfail(balancer)
    # The abuser fills its in-flight bound through the balancer with bodies it never finishes...
    holders = [attacker_socket(balancer.port, source=ABUSER) for _ in range(IN_FLIGHT)]
    for sock in holders:
        sock.sendall(speech_headers(30_000) + b'{"input": "')
    abuser = httpx.AsyncClient(base_url=balanced.http, transport=httpx.AsyncHTTPTransport(local_address=ABUSER))
    bystander = httpx.AsyncClient(base_url=balanced.http,
                                  transport=httpx.AsyncHTTPTransport(local_address=BYSTANDER))
    try:
        async def abuser_refused() -> str:
            answer = await abuser.post("/v1/audio/speech", json={"input": "Hello.", "voice": "alloy"})
            assert answer.status_code == 429, answer.text      # never a 502/503: the replica answers
            return answer.json()["error"]["message"]

        async def holding() -> bool:              # all 32 reached the replica through HAProxy
            return (await abuser.get("/healthz")).status_code == 429
        await wait_until_true(holding)
        # ...then goes on after 429s (bursts of 5 s at 20 a second: 100) until it is not heard.
        messages = [await abuser_refused()]
        while "after being refused" not in messages[-1] and len(messages) < 1000:
            messages.append(await abuser_refused())
        assert "in flight" in messages[0] and "after being refused" in messages[-1], (messages[0], messages[-1])
        print(f"\nthe abuser was not heard after {len(messages)} refusals through the balancer")
        # While it goes on, the bystander is served every time and HAProxy keeps the replica UP.
        # (The budget refills at 20 a second: between those, it is refused for what it holds.)
        for _ in range(24):
            await abuser_refused()
            spoken = await bystander.post("/v1/audio/speech", json={"input": "Still here.", "voice": "alloy",
                                                                    "response_format": "wav"})
            assert spoken.status_code == 200 and len(spoken.content) > 10_000, spoken.text[:200]
            assert balancer.states() == {"r1": "UP"}
        # A health check as HAProxy sends it (PROXY v2 LOCAL, from the balancer's address) is
        # answered: the balancer is never the client that was refused.
        with attacker_socket(balanced.port, source="127.0.0.1") as check:
            check.sendall(v2(None) + b"GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            assert read_until_closed(check).startswith(b"HTTP/1.1 200")
        assert chkfail(balancer) == failed_before
        # A forged X-Forwarded-For changes nothing: through the balancer the bystander naming the
        # abuser is still the bystander; straight to the replica (a peer it does not trust) the
        # abuser naming the bystander is still the abuser, whose 32 held requests are in flight:
        # refused, or not even heard.
        forged = await bystander.get("/healthz", headers={"X-Forwarded-For": ABUSER})
        assert forged.status_code == 200
        with attacker_socket(balanced.port, source=ABUSER) as direct:
            try:
                direct.sendall(speech_headers(30_000).replace(b"\r\n\r\n", b"\r\nX-Forwarded-For: "
                                                              + BYSTANDER.encode() + b"\r\n\r\n") + b'{"input": "')
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = read_until_closed(direct)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 429"), answer
    finally:
        for sock in holders:
            sock.close()
        await abuser.aclose()
        await bystander.aclose()
