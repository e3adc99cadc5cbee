"""Several devices in one server (`--device cpu,cpu` here: two schedulers, two copies of the tiny
VoxCPM2): placement by free slots, the same audio whichever device serves, voices on every
device, per-device figures, and what happens when one device's engine dies."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import connect_client
from helpers import tone_wav
from vox_ws.engine import EngineFailure
from vox_ws.engine_process.devices import parse_devices
from vox_ws.engines.voxcpm.engine import VoxCPMEngine
from vox_ws.testing.tone import ToneEngine

# The full lane runs these, not the quick one: together they took a minute or more of it (CONTRIBUTING.md, "Tests").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_cpus(start_server, tiny_model):
    engines = [VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2) for _ in range(2)]
    return start_server(engines, slots=2, max_streams=8)


def test_device_lists():
    assert parse_devices("cpu,cpu") == ["cpu", "cpu"]
    assert parse_devices(" cuda:0, cuda:1 ") == ["cuda:0", "cuda:1"]
    assert parse_devices("") == ["auto"]
    with pytest.raises(ValueError):
        parse_devices("cuda:all,cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        parse_devices("cuda:all")          # this machine has none


async def test_streams_go_to_the_device_with_the_most_free_slots_and_stay(two_cpus):
    async with connect_client(two_cpus) as c:
        for n in range(3):
            await c.send({"type": "start", "id": f"s{n}", "stream_input": True})
            await c.recv_where(lambda m, n=n: m["type"] == "start" and m["id"] == f"s{n}")
            placed = [d["streams_open"] for d in two_cpus.get("/v1/info")[1]["devices"]]
            assert placed == [[1, 0], [1, 1], [2, 1]][n]
        await c.send({"type": "cancel", "id": "s1"})          # device 1 frees up
        await c.recv_where(lambda m: m["type"] == "end" and m["id"] == "s1")
        await c.send({"type": "start", "id": "s3", "stream_input": True})
        await c.recv_where(lambda m: m["type"] == "start" and m["id"] == "s3")
        info = two_cpus.get("/v1/info")[1]
        assert [d["streams_open"] for d in info["devices"]] == [2, 1]
        assert info["slots"] == 4 and info["device"] == "cpu,cpu"
        for sid in ("s0", "s2", "s3"):
            await c.send({"type": "cancel", "id": sid})
            await c.recv_where(lambda m, sid=sid: m["type"] == "end" and m["id"] == sid)
    assert [d["streams_open"] for d in two_cpus.get("/v1/info")[1]["devices"]] == [0, 0]


async def test_the_same_seed_gives_the_same_audio_on_either_device(two_cpus):
    async with connect_client(two_cpus) as c:
        # Opened together, the two land on different devices.
        for sid in ("a", "b"):
            await c.send({"type": "start", "id": sid, "text": "Either device.", "options": {"seed": 21, "max_len": 6}})
        first, second = await c.collect("a"), await c.collect("b")
    steps = [d["steps_total"] for d in two_cpus.get("/v1/info")[1]["devices"]]
    assert all(s > 0 for s in steps), steps
    assert first.pcm().size > 0 and first.end["reason"] == "max_len"
    np.testing.assert_array_equal(first.pcm(), second.pcm())


async def test_a_registered_voice_speaks_on_every_device(two_cpus):
    async with connect_client(two_cpus) as c:
        await c.send({"type": "voice", "id": "r", "audio": tone_wav(1.0, pitch=200.0),
                      "transcript": "A test voice."})
        voice = (await c.recv_where(lambda m: m["type"] == "voice"))["voice"]
        for sid in ("a", "b"):
            await c.send({"type": "start", "id": sid, "text": "In the new voice.", "voice": voice,
                          "options": {"seed": 4, "max_len": 4}})
        one, two = await c.collect("a"), await c.collect("b")
        plain = await c.speak("In the new voice.", "p", options={"seed": 4, "max_len": 4})
    np.testing.assert_array_equal(one.pcm(), two.pcm())
    assert not np.array_equal(one.pcm(), plain.pcm())


def test_metrics_per_device(two_cpus):
    _, text = two_cpus.get("/metrics")
    for index in ("0", "1"):
        assert f'voxws_device_up{{device="cpu",index="{index}"}} 1.0' in text
        assert f'voxws_device_active_streams{{device="cpu",index="{index}"}}' in text


class DiesOnCue(ToneEngine):
    """A device whose engine dies (EngineFailure: the device is gone) on a text with the cue."""

    def step(self, batch):
        if any("DIE" in r.text for r in batch):
            raise EngineFailure("the device fell off the bus")
        return super().step(batch)


async def test_one_device_failing_leaves_the_others_serving(start_server):
    server = start_server([DiesOnCue(), ToneEngine()], slots=1)
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "doomed", "text": "DIE now please."})     # device 0
        error = await c.error("doomed")
        assert error["code"] == "unavailable" and error["retryable"] is True
        info = server.get("/v1/info")[1]
        assert [d["status"] for d in info["devices"]] == ["failed", "ready"]
        assert info["status"] == "ready" and server.get("/readyz")[0] == 200
        assert "device fell off" in info["error"]
        # New streams go to the device that is left, and speak.
        for sid in ("after1", "after2"):
            result = await c.speak("Still speaking.", sid)
            assert result.end["reason"] == "done" and result.seconds > 0.3
    _, text = server.get("/metrics")
    assert 'voxws_device_up{device="cpu",index="0"} 0.0' in text
    assert server.server.running            # the server did not exit


@pytest.mark.slow
async def test_slots_auto_sizes_the_slots_to_the_device(start_server, tiny_model):
    """`--slots auto` on a CPU: the engine times its batched step and keeps the most rows
    whose step takes at most half the audio it makes as the rows a step carries, and four KV
    slots a row (at most 32); hello and /v1/info say how many and why."""
    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=None), slots=None)
    info = server.get("/v1/info")[1]
    assert 1 <= info["step_rows"] <= info["slots"] <= min(32, 4 * info["step_rows"])
    assert "a step of B rows took" in info["slots_reason"] and "ms of audio each" in info["slots_reason"]
    assert info["slots_measure"] is None                 # sized once: not measured again
    async with connect_client(server) as c:
        assert (c.hello["slots"], c.hello["step_rows"]) == (info["slots"], info["step_rows"])
        result = await c.speak("Sized to the device.", "a", options={"seed": 1, "max_len": 4})
    assert result.end["reason"] == "max_len"


async def test_slots_auto_for_piper_follows_its_measured_speed(start_server):
    from vox_ws.engines.piper import PiperEngine

    server = start_server(PiperEngine(), slots=None)
    info = server.get("/v1/info")[1]
    assert info["slots"] >= 1 and "faster than real time" in info["slots_reason"]
    measure = info["slots_measure"]
    # A start on a busy machine (under 75% of the CPU it asked for) is measured again later.
    assert measure["contended"] == (measure["next_at"] is not None) and 0 < measure["cpu_share"] <= 1
    assert measure["remeasures"] == 0 and measure["speed"] > 0


def test_the_command_line_takes_auto_or_a_number_of_slots_by_either_spelling(monkeypatch):
    from vox_ws.commands.cli import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["serve"])).slots is None
    assert config_from_args(build_parser().parse_args(["serve", "--slots", "12"])).slots == 12
    assert config_from_args(build_parser().parse_args(["serve", "--max-batch", "12"])).slots == 12
    for spelling in ("--slots", "--max-batch"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", spelling, "0"])
    monkeypatch.setenv("VOX_WS_MAX_BATCH", "6")
    assert config_from_args(build_parser().parse_args(["serve"])).slots == 6
    monkeypatch.setenv("VOX_WS_SLOTS", "5")
    assert config_from_args(build_parser().parse_args(["serve"])).slots == 5


async def test_a_lora_adapter_loads_on_every_device(start_server, tiny_model, tmp_path):
    """Loaded once, it is in a slot on each device; a stream naming it speaks the same on
    either, and one naming none speaks with the base model on either."""
    from vox_ws.testing.lora_adapters import RandomAdapter, write_adapter

    write_adapter(tiny_model, tmp_path / "bright", RandomAdapter(rank=4, alpha=8, seed=1, scale=0.25))
    engines = [VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, lora_rank=4, lora_dir=str(tmp_path))
               for _ in range(2)]
    server = start_server(engines, slots=1, admin_tokens=["admin-secret"])

    async def pair(c, **fields) -> tuple:
        """The same request on each device (one slot each: opened together, one per device)."""
        for sid in ("d0", "d1"):
            await c.send({"type": "start", "id": sid, "text": "Adapter.", "options": {"seed": 5, "max_len": 4},
                          **fields})
        return (await c.collect("d0")).pcm(), (await c.collect("d1")).pcm()

    async with connect_client(server, additional_headers={"Authorization": "Bearer admin-secret"}) as c:
        plain = await pair(c)
        await c.send({"type": "lora", "id": "l", "op": "load", "name": "bright"})
        loaded = await c.recv_where(lambda m: m.get("id") == "l")
        assert loaded["type"] == "lora" and loaded["loaded"] > 0, loaded
        adapted = await pair(c, lora="bright")
        unadapted = await pair(c)
    assert all([a["name"] for a in engine.loras.describe()["adapters"]] == ["bright"] for engine in engines)
    np.testing.assert_array_equal(adapted[0], adapted[1])            # both devices changed alike
    assert not np.allclose(adapted[0], plain[0])
    for pcm in (*unadapted, plain[1]):
        np.testing.assert_array_equal(pcm, plain[0])


def test_cuda_all_is_counted_in_a_process_of_its_own_and_each_gpu_is_its_processs_cuda_0():
    """The server imports no torch: `cuda:all` is counted by a child (here, a count given), and
    each engine process sees its one GPU as `cuda:0` (`CUDA_VISIBLE_DEVICES`), so the compiled
    graphs one writes into the compile cache name the device every other one is."""
    from vox_ws.engine_process.devices import seen_as

    assert parse_devices("cuda:all", count=lambda: 3) == ["cuda:0", "cuda:1", "cuda:2"]
    with pytest.raises(ValueError, match="no CUDA device"):
        parse_devices("cuda:all", count=lambda: 0)
    assert seen_as("cuda:2", visible="") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "2"})
    assert seen_as("cuda:1", visible="4,6") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "6"})
    assert seen_as("cuda", visible="5") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "5"})
    assert seen_as("cpu") == ("cpu", {}) and seen_as("auto") == ("auto", {})
    with pytest.raises(ValueError, match="has 2 device"):
        seen_as("cuda:2", visible="4,6")


def test_one_engine_process_per_device_each_placed_on_cpus_of_its_own():
    from vox_ws.config import ServerConfig
    from vox_ws.engine_process.devices import engine_specs

    config = ServerConfig(engine="voxcpm", engines_per_device=2, engine_cpus="0;1;0;1", slots=4,
                          engine_settings={"compile": "off"})
    specs, server_cpus = engine_specs(config, ["cuda:0", "cuda:1"])
    assert [s.label for s in specs] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert [s.env for s in specs] == [{"CUDA_VISIBLE_DEVICES": "0"}] * 2 + [{"CUDA_VISIBLE_DEVICES": "1"}] * 2
    assert {s.settings["device"] for s in specs} == {"cuda:0"}
    assert [s.cpus for s in specs] == [(0,), (1,), (0,), (1,)]
    assert all(s.settings["compile"] == "off" and s.loop.slots == 4 for s in specs)
    assert specs[0].preload == ("vox_ws.engines.voxcpm.engine",)
