"""Many LoRA adapters on one model: loaded by name into slots, chosen per stream, batched together.

A real server on the tiny VoxCPM2 with two adapter slots of rank 4; adapters are written in the
voxcpm package's own format (keys and shapes from the package's model built with a LoRA config),
and every stream's audio is checked against the package alone with only that stream's adapter
loaded (`load_lora_weights`). Streams are held in flight by back-pressure (one second of audio
ahead at most, and the test does not read), so "while another stream speaks" is certain."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from benchmarks.equivalence import package_noise
from conftest import assert_good_stream, connect_client
from vox_ws.engines.voxcpm.engine import VoxCPMEngine
from vox_ws.testing.lora_adapters import RandomAdapter, package_model, write_adapter

# The full lane runs these, not the quick one: together they took a minute or more of it (CONTRIBUTING.md, "Tests").
pytestmark = pytest.mark.slow

ADMIN = "lora-admin"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
TEXT = "Adapters, one per stream."
TOLERANCE = 1e-4
CHUNK_SAMPLES = 7680


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("loras")
    rank4 = package_model(tiny_model, 4, 8)
    write_adapter(tiny_model, folder / "bright", RandomAdapter(seed=1, scale=0.25), model=rank4)
    write_adapter(tiny_model, folder / "third", RandomAdapter(seed=3, scale=0.25), model=rank4)
    # Rank 2 under rank-4 slots, with its own r and alpha (scaling 1, not the server's 2).
    write_adapter(tiny_model, folder / "soft", RandomAdapter(rank=2, alpha=2, seed=2, scale=0.25, with_config=True))
    write_adapter(tiny_model, folder / "wide", RandomAdapter(rank=8, alpha=16, seed=4))
    state = rank4.tts_model.get_lora_state_dict()
    a_key = next(k for k in state if k.endswith("lora_A"))
    save_file({"nothing.here": torch.zeros(2)}, str(folder / "empty.safetensors"))
    save_file({a_key: torch.zeros(4, 3), a_key.replace("lora_A", "lora_B"): torch.zeros(3, 4)},
              str(folder / "mismatch.safetensors"))
    base_key = next(k for k, _ in rank4.tts_model.named_parameters() if "lora_" not in k)
    save_file({**state, base_key: dict(rank4.tts_model.named_parameters())[base_key].detach().clone()},
              str(folder / "base.safetensors"))
    (folder / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    write_adapter(tiny_model, folder / "listconfig", RandomAdapter(seed=5), model=rank4)
    (folder / "listconfig" / "lora_config.json").write_text("[4, 8]")
    # Finite weights of 3e38: past what any activation times them can hold (refused at load), and
    # of 1e12: accepted, but the stream speaking with them overflows to NaN in its own rows.
    for name, size in (("huge", 3e38), ("loud", 1e12)):
        (folder / name).mkdir()
        save_file({key: torch.full(value.shape, size) for key, value in state.items()},
                  str(folder / name / "lora_weights.safetensors"))
    outside = tmp_path_factory.mktemp("outside")
    write_adapter(tiny_model, outside / "evil", RandomAdapter(seed=9), model=rank4)
    (folder / "escape").symlink_to(outside / "evil")
    # Good weights, with a config that is a link out of the directory (alpha 400 there), a FIFO
    # (reading it would never end) or far past any config's size.
    (outside / "loud.json").write_text('{"r": 4, "alpha": 400}')
    for name in ("linkconfig", "fifoconfig", "bigconfig"):
        write_adapter(tiny_model, folder / name, RandomAdapter(seed=6), model=rank4)
    (folder / "linkconfig" / "lora_config.json").symlink_to(outside / "loud.json")
    os.mkfifo(folder / "fifoconfig" / "lora_config.json")
    (folder / "bigconfig" / "lora_config.json").write_text('{"r": 4, "alpha": 8, "pad": "' + "x" * 70_000 + '"}')
    return folder


@pytest.fixture(scope="module")
def server(start_server, tiny_model, adapters):
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=4, lora_rank=4, max_loras=2,
                          lora_dir=str(adapters))
    # Unloads here wait for their streams (lora_unload_timeout_s is tested on a server of its own).
    return start_server(engine, slots=4, max_streams=8, admin_tokens=[ADMIN], max_buffered_audio_s=1.0,
                        lora_unload_timeout_s=600.0)


def package_audio(tiny_model, adapters: Path, adapter: str | None, seed: int, max_len: int) -> np.ndarray:
    """The package alone: its own generation, with only this adapter loaded (or none)."""
    from vox_ws.engines.voxcpm.loading import import_voxcpm

    if adapter is None:
        tts = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                     device="cpu")
    else:
        rank, alpha = (2, 2) if adapter == "soft" else (4, 8)
        tts = package_model(tiny_model, rank, alpha)
        loaded, skipped = tts.tts_model.load_lora_weights(str(adapters / adapter))
        assert loaded and not skipped
    with package_noise(seed):       # the server's noise for that seed
        return np.concatenate(list(tts.generate_streaming(text=TEXT, retry_badcase=False, max_len=max_len)))


def assert_is_the_packages(result, tiny_model, adapters, adapter: str | None, seed: int, max_len: int) -> None:
    want = package_audio(tiny_model, adapters, adapter, seed, max_len)
    got = result.pcm()
    assert got.shape == want.shape, (adapter, got.shape, want.shape)
    assert np.max(np.abs(got - want)) < TOLERANCE, (adapter, float(np.max(np.abs(got - want))))


def assert_after_the_first_chunk_is_the_packages(result, tiny_model, adapters, adapter, seed, max_len) -> None:
    """For a stream whose first chunk (160 ms) the test read apart."""
    want = package_audio(tiny_model, adapters, adapter, seed, max_len)[CHUNK_SAMPLES:]
    got = result.pcm()
    assert got.shape == want.shape and np.max(np.abs(got - want)) < TOLERANCE


async def lora(admin, op: str, name: str | None = None) -> dict:
    """One `lora` request's answer: its reply, or its error."""
    message = {"type": "lora", "id": f"{op}-{name}", "op": op}
    if name is not None:
        message["name"] = name
    await admin.send(message)
    return await admin.recv_where(lambda m: m.get("id") == f"{op}-{name}")


def start(sid: str, adapter: str | None, seed: int, max_len: int) -> dict:
    message = {"type": "start", "id": sid, "text": TEXT, "options": {"seed": seed, "max_len": max_len}}
    if adapter is not None:
        message["lora"] = adapter
    return message


def listed(server) -> dict:
    status, body = server.get("/v1/loras")
    assert status == 200
    return body


async def test_streams_with_different_adapters_each_speak_with_their_own(server, tiny_model, adapters):
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin:
        assert (await lora(admin, "load", "bright"))["slot"] == 0
        soft = await lora(admin, "load", "soft")
        assert soft["slot"] == 1 and soft["rank"] == 2 and soft["scaling"] == 1.0 and soft["skipped"] == 0
        try:
            for sid, adapter in (("b", "bright"), ("n", None), ("s", "soft")):
                await admin.send(start(sid, adapter, 7, 6))
            results = {sid: await admin.collect(sid) for sid in ("b", "n", "s")}
        finally:
            await lora(admin, "unload", "bright")
            await lora(admin, "unload", "soft")
    for sid, adapter in (("b", "bright"), ("n", None), ("s", "soft")):
        assert_good_stream(results[sid], reason="max_len")
        assert_is_the_packages(results[sid], tiny_model, adapters, adapter, 7, 6)
    assert not np.allclose(results["b"].pcm(), results["n"].pcm(), atol=1e-3), "the adapter must change the audio"
    assert listed(server)["adapters"] == []


async def test_load_and_unload_while_another_stream_speaks(server, tiny_model, adapters):
    """A stream without an adapter is in the engine (held by back-pressure) while an adapter
    loads, another stream speaks with it, and it unloads: its audio is the package's, unchanged."""
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin, \
            connect_client(server) as user:
        await user.send(start("flight", None, 3, 40))
        await user.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "flight")
        loaded = await lora(admin, "load", "bright")
        assert loaded["type"] == "lora" and loaded["loaded"] > 0 and loaded["skipped"] == 0, loaded
        adapted = await user.speak(TEXT, "adapted", lora="bright", options={"seed": 3, "max_len": 4})
        unloaded = await lora(admin, "unload", "bright")
        assert unloaded["unloaded"] is True and unloaded["streams_using"] == 0, unloaded
        flight = await user.collect("flight")
    assert flight.end["reason"] == "max_len"
    assert_after_the_first_chunk_is_the_packages(flight, tiny_model, adapters, None, 3, 40)
    assert_is_the_packages(adapted, tiny_model, adapters, "bright", 3, 4)


async def test_an_adapter_in_use_unloads_when_its_streams_end_and_takes_no_new_ones(server, tiny_model, adapters):
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin, \
            connect_client(server) as user:
        await lora(admin, "load", "bright")
        await user.send(start("using", "bright", 5, 30))
        await user.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "using")
        unloading = await lora(admin, "unload", "bright")
        assert unloading["unloaded"] is False and unloading["streams_using"] == 1, unloading
        assert [(a["name"], a["state"], a["streams"]) for a in listed(server)["adapters"]] == \
            [("bright", "unloading", 1)]
        await user.send(start("late", "bright", 5, 4))
        refused = await user.error("late")
        assert refused["code"] == "bad_request" and "being unloaded" in refused["message"], refused
        again = await lora(admin, "load", "bright")
        assert again["type"] == "error" and "being unloaded" in again["message"], again
        using = await user.collect("using")
    assert using.end["reason"] == "max_len"
    assert listed(server)["adapters"] == []            # freed once the stream ended
    assert_after_the_first_chunk_is_the_packages(using, tiny_model, adapters, "bright", 5, 30)


async def test_slots_run_out_and_free_up(server):
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin:
        await lora(admin, "load", "bright")
        await lora(admin, "load", "soft")
        full = await lora(admin, "load", "third")
        assert full["type"] == "error" and full["code"] == "too_large" and "2 LoRA slots" in full["message"], full
        assert not full["retryable"]
        await lora(admin, "unload", "soft")
        third = await lora(admin, "load", "third")
        assert third["slot"] == 1, third
        assert sorted(a["name"] for a in listed(server)["adapters"]) == ["bright", "third"]
        unnamed = await lora(admin, "unload")
        assert unnamed["type"] == "error" and "'name' is needed: 2 adapters" in unnamed["message"], unnamed
        await lora(admin, "unload", "bright")
        assert (await lora(admin, "enable"))["default"] == "third"       # the only one loaded
        gone = await lora(admin, "unload")
        assert gone["name"] == "third" and gone["unloaded"] is True and gone["lora"]["default"] is None


@pytest.mark.parametrize("name, code, words", [
    ("missing", "bad_request", "no LoRA adapter named"),
    ("../etc/passwd", "bad_request", "adapter name"),
    (".hidden", "bad_request", "adapter name"),
    ("a/b", "bad_request", "adapter name"),
    ("escape", "bad_request", "no LoRA adapter named"),       # a link out of --lora-dir
    ("empty", "bad_request", "matched no LoRA layer"),
    ("mismatch", "bad_request", "does not fit this model"),
    ("wide", "too_large", "rank 8"),
    ("base", "bad_request", "weights of the base model"),
    ("corrupt", "bad_request", "cannot be read"),
    ("listconfig", "bad_request", "lora_config.json is not a JSON object"),
    ("huge", "bad_request", "could grow an activation"),
    ("linkconfig", "bad_request", "lora_config.json points out of the LoRA directory"),
    ("fifoconfig", "bad_request", "lora_config.json is not a regular file"),
    ("bigconfig", "too_large", "lora_config.json is over 65536 bytes"),
    ("日" * 64, "bad_request", "up to 128 bytes"),              # 192 bytes: past a file name's
])
async def test_bad_adapters_are_refused_and_nothing_changes(server, adapters, name, code, words):
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin:
        refused = await lora(admin, "load", name)
        assert refused["type"] == "error" and refused["code"] == code and words in refused["message"], refused
        assert str(adapters) not in refused["message"] and "/tmp" not in refused["message"]   # no server paths
        result = await admin.speak(TEXT, "after", options={"seed": 1, "max_len": 2})
    assert_good_stream(result, reason="max_len")
    assert listed(server)["adapters"] == []


async def test_an_adapter_file_over_the_size_bound_is_refused_before_it_is_read(server, monkeypatch):
    from vox_ws.engines.voxcpm import adapters as adapter_files

    monkeypatch.setattr(adapter_files, "MAX_ADAPTER_BYTES", 1024)     # the tiny adapters are larger
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin:
        refused = await lora(admin, "load", "bright")
        assert refused["type"] == "error" and refused["code"] == "too_large", refused
        assert "over the 1024 an adapter file may have" in refused["message"]
        assert_good_stream(await admin.speak(TEXT, "after", options={"seed": 1, "max_len": 2}), reason="max_len")
    assert listed(server)["adapters"] == []


async def test_a_stream_naming_an_adapter_not_loaded_is_refused(server):
    async with connect_client(server) as user:
        await user.send(start("s", "bright", 1, 2))
        refused = await user.error("s")
        assert refused["code"] == "bad_request" and "unknown LoRA adapter 'bright'" in refused["message"]
        await user.send({**start("e", None, 1, 2), "lora": 3})
        assert (await user.error("e"))["code"] == "bad_request"
        assert_good_stream(await user.speak(TEXT, "ok", options={"seed": 1, "max_len": 2}), reason="max_len")


async def test_admin_token_over_v1_and_http_and_the_default_adapter(server, tiny_model, adapters):
    async with connect_client(server) as user:
        await user.send({"type": "lora", "id": "l", "op": "load", "name": "bright"})
        assert (await user.error("l"))["code"] == "unauthorized"
    async with httpx.AsyncClient(base_url=server.http) as http:
        assert (await http.post("/v1/loras/bright")).status_code == 403
        assert (await http.post("/v1/loras/bright", headers={"Authorization": "Bearer wrong"})).status_code == 403
        assert (await http.post("/v1/loras/bright", headers=ADMIN_HEADERS, content=b"[1]")).status_code == 400
        huge = await http.post("/v1/loras/bright", headers=ADMIN_HEADERS, content=b" " * 4096)
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "too_large"
        made = await http.post("/v1/loras/bright", headers=ADMIN_HEADERS, json={"default": True})
        assert made.status_code == 201 and made.json()["default"] == "bright", made.text
        assert made.json()["slot"] == 0 and made.json()["loaded"] > 0
        body = (await http.get("/v1/loras")).json()
        assert body["default"] == "bright" and [a["name"] for a in body["adapters"]] == ["bright"]
        async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin:
            by_default = await admin.speak(TEXT, "d", options={"seed": 2, "max_len": 4})     # names none
            named = await admin.speak(TEXT, "n", lora="bright", options={"seed": 2, "max_len": 4})
            assert (await lora(admin, "disable"))["default"] is None
            plain = await admin.speak(TEXT, "p", options={"seed": 2, "max_len": 4})
        np.testing.assert_array_equal(by_default.pcm(), named.pcm())
        assert_is_the_packages(plain, tiny_model, adapters, None, 2, 4)
        assert (await http.delete("/v1/loras/bright")).status_code == 403
        gone = await http.delete("/v1/loras/bright", headers=ADMIN_HEADERS)
        assert gone.status_code == 200 and gone.json() == {"name": "bright", "unloaded": True, "streams_using": 0}
        assert (await http.delete("/v1/loras/bright", headers=ADMIN_HEADERS)).status_code == 404
        missing = await http.post("/v1/loras/missing", headers=ADMIN_HEADERS)
        assert missing.status_code == 400 and "no LoRA adapter named" in missing.json()["error"]["message"]


def test_info_reports_the_slots_and_what_one_costs(server, tiny_model):
    status, info = server.get("/v1/info")
    assert "lora" in info["features"]
    state = package_model(tiny_model, 4, 8).tts_model.get_lora_state_dict()
    # A slot holds one rank-4 adapter: exactly what the package keeps for one.
    assert info["lora"]["slot_bytes"] == sum(v.numel() * v.element_size() for v in state.values())
    assert info["lora"]["slots"] == 2 and info["lora"]["rank"] == 4 and info["lora"]["configured"] is True


async def test_the_openai_door_takes_an_adapter_by_name(server):
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin:
        await lora(admin, "load", "bright")
        try:
            body = {"seed": 4, "max_len": 4, "lora": "bright"}
            speech = await _to_thread(lambda: client.audio.speech.create(
                model="tts-1", voice="alloy", input=TEXT, response_format="pcm", extra_body=body).content)
            v1 = await admin.speak(TEXT, "v1", lora="bright", format="s16", sample_rate=24000, voice="alloy",
                                   options={"seed": 4, "max_len": 4})
            with pytest.raises(openai.BadRequestError) as refused:
                await _to_thread(lambda: client.audio.speech.create(
                    model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
                    extra_body={"lora": "missing"}).content)
        finally:
            await lora(admin, "unload", "bright")
    assert speech == b"".join(c["audio"] for c in v1.chunks)
    assert refused.value.body["param"] == "lora" and "unknown LoRA adapter" in refused.value.body["message"]


async def _to_thread(fn):
    import asyncio

    return await asyncio.to_thread(fn)


async def test_audio_that_is_not_finite_is_never_sent_and_fails_only_its_stream(server):
    """The `loud` adapter's rows overflow: that stream fails with a typed error and no audio;
    a stream without an adapter, at the same time, and the next ones speak as ever."""
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin:
        assert (await lora(admin, "load", "loud"))["type"] == "lora"
        try:
            await admin.send(start("plain", None, 2, 6))
            await admin.send(start("loud", "loud", 2, 6))
            failed = await admin.error("loud")
            plain = await admin.collect("plain")
        finally:
            await lora(admin, "unload", "loud")
        assert failed["code"] == "internal" and "not finite" in failed["message"], failed
        assert ("chunk", "loud") not in admin.log
        assert_good_stream(plain, reason="max_len")
        assert np.isfinite(plain.pcm()).all()
        assert_good_stream(await admin.speak(TEXT, "after", options={"seed": 1, "max_len": 2}), reason="max_len")


def test_a_row_gathers_only_its_own_adapter():
    """Rows of one forward, each with its own slot (or none): a row without an adapter is exactly
    the base layer's output, and a row's result is the same whatever the other slots hold, even
    weights that overflow (where a mask multiplying every slot gave inf x 0 = NaN)."""
    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.engines.voxcpm.lora import NO_ADAPTER, RowAdapters, RowLoRALinear

    import_voxcpm()
    from voxcpm.modules.layers.lora import LoRALinear

    torch.manual_seed(0)
    base = LoRALinear(torch.nn.Linear(16, 8), r=4, alpha=8)
    adapters = RowAdapters(slots=3, rank=4, device="cpu", dtype=torch.float32)
    layer = RowLoRALinear(base, adapters)
    a, b = torch.randn(4, 16) * 0.1, torch.randn(8, 4) * 0.1
    layer.put(0, a, b, 2.0)
    layer.put(1, torch.full((4, 16), 1e30), torch.full((8, 4), 1e30), 2.0)     # overflows: x A^T B^T = inf
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        with adapters.rows([NO_ADAPTER, 0, 1], gathered=True):
            out = layer(x)
        plain = torch.nn.functional.linear(x, base.weight, base.bias)
    assert torch.equal(out[0], plain[0])                                        # untouched: bit for bit
    torch.testing.assert_close(out[1], plain[1] + (x[1] @ a.t() @ b.t()) * 2.0)
    assert not torch.isfinite(out[2]).all()                                     # only its own row
    layer.put(2, torch.full((4, 16), 1e30), torch.full((8, 4), 1e30), 2.0)     # a loaded, unused slot
    with torch.no_grad(), adapters.rows([NO_ADAPTER, 0], gathered=True):
        again = layer(x[:2])
    assert torch.equal(again, out[:2])


async def test_an_unload_ends_the_streams_still_using_it_once_its_time_is_up(start_server, tiny_model, adapters):
    """A stream that keeps its input open (as one sending a word every few seconds would) holds
    an unloading adapter only for `lora_unload_timeout_s`: then it ends, typed, and the slot frees."""
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2, lora_rank=4, max_loras=1,
                          lora_dir=str(adapters))
    server = start_server(engine, slots=2, admin_tokens=[ADMIN], lora_unload_timeout_s=0.5,
                          stream_timeout_s=600.0)
    async with connect_client(server, additional_headers=ADMIN_HEADERS) as admin, \
            connect_client(server) as user:
        await lora(admin, "load", "bright")
        await user.send({"type": "start", "id": "held", "stream_input": True, "lora": "bright",
                         "options": {"seed": 1, "max_len": 2}})
        await user.send({"type": "chunk", "id": "held", "text": "Still here. "})
        await user.recv_where(lambda m: m["type"] == "segment" or (m["type"] == "chunk" and m["id"] == "held"))
        unloading = await lora(admin, "unload", "bright")
        assert unloading["unloaded"] is False and unloading["streams_using"] == 1, unloading
        ended = await user.error("held")
        assert ended["code"] == "bad_request" and "'bright' was unloaded" in ended["message"], ended
        assert listed(server)["adapters"] == []
        assert (await lora(admin, "load", "soft"))["slot"] == 0          # the one slot is free again
        assert_good_stream(await user.speak(TEXT, "after", lora="soft", options={"seed": 1, "max_len": 2}),
                           reason="max_len")
        await lora(admin, "unload", "soft")
