"""The compiled step (`--compile`): readiness while it compiles, the compile cache, and what
`auto` picks. (Its audio equals the package's: tests/test_voxcpm_equivalence.py.)"""

from __future__ import annotations

import threading

from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client
import pytest

from vox_ws.engines.voxcpm import parse_buckets, parse_compile
from vox_ws.engines.voxcpm.compiled import buckets_for
from vox_ws.engines.voxcpm.engine import VoxCPMEngine


def test_buckets_cover_every_batch_up_to_the_rows():
    assert buckets_for(1) == (1,)
    assert buckets_for(8) == (1, 2, 4, 8)
    assert buckets_for(12) == (1, 2, 4, 8, 16)
    assert buckets_for(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert buckets_for(6, (4,)) == (4, 6)
    assert parse_buckets("8, 1,2") == (1, 2, 8) and parse_compile(" ON ") == "on"
    for bad in ("0,1", "", "x"):
        with pytest.raises(ValueError):
            parse_buckets(bad)
    with pytest.raises(ValueError):
        parse_compile("sometimes")
    with pytest.raises(ValueError):
        VoxCPMEngine(compile="yes")


def test_auto_leaves_the_step_eager_on_a_cpu(tiny_model):
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", max_batch=1, compile="auto")
    engine.load()
    try:
        assert engine.compiled is None and engine.runner.compiled is None
        assert engine.describe()["compile"] == {"mode": "auto", "compiled": False, "buckets": [], "compile_s": {}}
    finally:
        engine.close()


@pytest.mark.slow
async def test_readyz_says_compiling_until_the_step_is_compiled_then_it_serves(start_server, tiny_model, tmp_path):
    """The compile waits for the test (so "compiling" is seen whatever the machine's speed),
    then compiles one bucket into the given cache."""
    entered, release = threading.Event(), threading.Event()

    class HeldCompile(VoxCPMEngine):
        def _compile_step(self, model):
            self.loading_phase = "compiling"
            entered.set()
            assert release.wait(WAIT_TIMEOUT)
            super()._compile_step(model)

    cache = tmp_path / "cache"
    engine = HeldCompile(model=str(tiny_model), device="cpu", max_batch=1, compile="on", compile_buckets=(1,),
                         compile_cache=str(cache))
    server = start_server(engine, wait=False, max_batch=1)
    assert entered.wait(WAIT_TIMEOUT)
    status, body = server.get("/readyz")
    assert status == 503 and body["status"] == "compiling", body
    async with connect_client(server) as c:
        assert c.hello["status"] == "compiling"
        await c.send({"type": "start", "id": "early", "text": "Too soon."})
        refused = await c.error("early")
        assert refused["code"] == "not_ready" and "compiling" in refused["message"], refused
    release.set()
    server.wait_ready()
    status, info = server.get("/v1/info")
    assert info["compile"]["compiled"] is True and info["compile"]["buckets"] == [1], info["compile"]
    assert any(cache.rglob("*")), "the compiled code must be kept in the cache directory"
    async with connect_client(server) as c:
        assert_good_stream(await c.speak("Compiled now.", options={"seed": 1, "max_len": 3}), reason="max_len")
