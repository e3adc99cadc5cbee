"""The engine registry: plug-ins, `auto`, the command line built from it, the option vocabulary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import assert_good_stream, connect_client
from vox_ws import engines
from vox_ws.commands.cli import build_parser, config_from_args
from vox_ws.engine import ErrorKind, OptionSpec, Refused
from vox_ws.testing import tone


@pytest.fixture
def tone_registered():
    engines.register(tone.PLUGIN)
    yield
    engines.unregister("tone")


def test_built_in_engines_and_their_declarations():
    plugins = engines.plugins()
    assert {"piper", "voxcpm"} <= set(plugins)
    assert set(plugins["voxcpm"].options) == {"cfg_value", "inference_timesteps", "min_len", "max_len", "normalize",
                                              "denoise", "seed"}
    assert set(plugins["piper"].options) == {"max_len", "length_scale", "noise_scale", "noise_w_scale",
                                             "sentence_silence"}
    assert {s.name for s in plugins["voxcpm"].settings} >= {"model", "lora-rank", "voices-dir"}
    vocabulary = engines.option_vocabulary()
    assert vocabulary["cfg_value"].check(2) == 2.0
    with pytest.raises(ValueError, match=r"must be in \[0.0, 10.0\]"):
        vocabulary["cfg_value"].check(11)
    with pytest.raises(ValueError, match="must be a number"):
        OptionSpec(int, 0, 5).check(True)


def test_auto_never_picks_a_plugin_without_priority_and_falls_back_to_the_cpu_voice(tone_registered):
    name, why, notices = engines.choose_auto({"device": "auto"})
    assert name == "piper" and "not voxcpm" in why and notices == []     # no GPU: nothing was missed
    assert engines.choose_auto({"device": "cpu"})[0] == "piper"
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        engines.create_engine("nope", {})


async def test_a_registered_engine_is_served_end_to_end(tone_registered, start_server):
    engine = engines.create_engine("tone", {"slots": 8})
    assert isinstance(engine, tone.ToneEngine)
    server = start_server(engine, slots=8)
    async with connect_client(server) as c:
        assert c.hello["engine"] == "tone" and c.hello["options"] == []
        result = await c.speak("A tone of some length.", "t", options={"cfg_value": 3})
        assert result.start["ignored_options"] == ["cfg_value"]
        assert_good_stream(result, 0.5)
        bad = await c.speak("Hi.", "u", options={"nope": 1})
        assert bad.error["code"] == "bad_request" and "options.nope" in bad.error["message"]


async def test_a_gpu_without_weights_is_told_how_to_get_them(monkeypatch, tmp_path, start_server):
    """This machine has no GPU: CUDA is reported present to `auto`, so that it finds a GPU and no
    weights, serves the CPU voice, and says so in the log, `hello` and /v1/info, with the command."""
    import httpx
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hub-cache"))
    name, why, notices = engines.choose_auto({"device": "auto"})
    assert name == "piper" and len(notices) == 1
    assert "a CUDA GPU is present but VoxCPM2 is not served" in notices[0]
    assert "`vox-ws models pull`" in notices[0]
    assert "vox-ws models pull some/Other" in engines.choose_auto({"device": "auto", "model": "some/Other"})[2][0]
    assert "--model" in engines.choose_auto({"device": "auto", "model": str(tmp_path / "none")})[2][0]

    engine = engines.create_engine("auto", {"device": "auto"})
    monkeypatch.undo()                     # the engine runs on this machine's CPU
    assert engine.name == "piper" and engine.notice == notices[0]
    server = start_server(engine)
    async with connect_client(server) as c:
        assert c.hello["notice"] == notices[0]
    async with httpx.AsyncClient() as http:
        info = (await http.get(f"http://127.0.0.1:{server.port}/v1/info")).json()
    assert info["notice"] == notices[0]


def test_command_line_offers_each_engines_settings_and_reads_the_environment(monkeypatch):
    monkeypatch.setenv("VOX_WS_LORA_RANK", "8")
    args = build_parser().parse_args(["serve", "--engine", "voxcpm", "--model", "/m", "--max-batch", "4"])
    config = config_from_args(args)
    assert config.engine == "voxcpm" and config.slots == 4
    assert config.engine_settings["lora_rank"] == 8 and config.engine_settings["model"] == "/m"
    assert config.engine_options()["slots"] == 4 and config.engine_options()["device"] == "auto"
    # A default start compiles in the background; --compile-wait is the old blocking start.
    assert (config.engine_settings["compile"], config.engine_settings["compile_wait"]) == ("auto", False)
    engine = engines.create_engine("voxcpm", config.engine_options())
    assert (engine.settings.compile, engine.settings.compile_wait) == ("auto", False)
    waiting = build_parser().parse_args(["serve", "--engine", "voxcpm", "--compile-wait", "true"])
    assert config_from_args(waiting).engine_settings["compile_wait"] is True
    text = subprocess.run([sys.executable, "-m", "vox_ws", "serve", "--help"], capture_output=True, text=True).stdout
    assert "engines: auto, piper, voxcpm" in text and "voxcpm engine:" in text and "--lora-rank" in text


def test_voxcpm_is_built_from_one_settings_object_with_a_field_for_each_of_its_options():
    import dataclasses

    from vox_ws.engines.voxcpm.engine import VoxCPMEngine
    from vox_ws.engines.voxcpm.settings import COMMON, SETTINGS, VoxCPMSettings

    assert {f.name for f in dataclasses.fields(VoxCPMSettings)} == set(COMMON) | {s.key for s in SETTINGS}
    settings = VoxCPMSettings(model="/m", device="cpu", slots=2, lora_rank=4)
    engine = VoxCPMEngine(settings, step_rows=1)             # a field by name wins over the object's
    assert engine.settings == dataclasses.replace(settings, step_rows=1)
    assert (engine.model, engine.max_step_batch, engine.slots()[0]) == ("/m", 1, 2)
    for wrong in ({"compile": "sometimes"}, {"optimize": True}, {"cuda_graphs": True},
                  {"cuda_graphs": True, "compile": "on", "lora_rank": 4}, {"lora_rank": 4, "max_loras": 0}):
        with pytest.raises(ValueError, match="--"):
            VoxCPMSettings(**wrong)
    with pytest.raises(TypeError):
        VoxCPMEngine(no_such_setting=1)


def test_engines_refuse_in_their_own_vocabulary():
    from vox_ws.engines.piper import PiperEngine

    with pytest.raises(Refused) as info:
        PiperEngine().voices.register(None, 16000, None, "reference")
    assert info.value.kind == ErrorKind.UNSUPPORTED and not info.value.kind.retryable
