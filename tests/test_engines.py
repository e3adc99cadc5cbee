"""The engine registry: plug-ins, `auto`, the command line built from it, the option vocabulary."""

from __future__ import annotations

import contextlib
import io
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


# ------------------------------------------------------------------------------ other packages' engines

CHIRP = '''
from vox_ws.engines import EnginePlugin, Setting
from vox_ws.testing.tone import ToneEngine


class Chirp(ToneEngine):
    name = "chirp"


PLUGIN = EnginePlugin(name="chirp", summary="a tone from another package",
                      create=lambda settings: Chirp(slots=settings.get("slots") or 4),
                      settings=(Setting("chirp-rate", int, 24000, "its rate"),))
'''


def serve_help() -> str:
    """What `vox-ws serve --help` prints, from this process's registry."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return printed.getvalue()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on the path that packages are installed into as pip lays them out (a module, its
    distribution's metadata with its entry points), and a registry that has loaded nothing yet
    (restored after the test, with the modules the test imported)."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    for name, fresh in (("_plugins", {}), ("_unavailable", {}), ("_found", []), ("_loaded", False)):
        monkeypatch.setattr(engines, name, fresh)
    modules: list[str] = []

    def install(distribution: str, points: dict[str, str], sources: dict[str, str]) -> None:
        for module, source in sources.items():
            (folder / f"{module}.py").write_text(source)
            modules.append(module)
        info = folder / f"{distribution.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(
            "[vox_ws.engines]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()))

    yield install
    for module in modules:
        sys.modules.pop(module, None)


async def test_another_packages_engine_is_found_by_its_entry_point_and_served(site, start_server):
    import httpx

    site("vox-ws-chirp", {"chirp": "chirp_engine:PLUGIN"}, {"chirp_engine": CHIRP})
    assert {"piper", "voxcpm", "chirp"} <= set(engines.plugins())
    found = {e.name: e for e in engines.installed()}
    assert found["chirp"].source == "vox-ws-chirp 1.0" and found["chirp"].available
    assert found["piper"].source == "built-in"
    args = build_parser().parse_args(["serve", "--engine", "chirp", "--chirp-rate", "16000"])
    config = config_from_args(args)
    assert config.engine_settings["chirp_rate"] == 16000
    text = serve_help()
    assert "engines: auto, chirp, piper, voxcpm\n" in text and "--chirp-rate CHIRP_RATE" in text
    assert "chirp engine: a tone from another package:" in text
    assert "  chirp (from vox-ws-chirp 1.0): a tone from another package\n" in text

    server = start_server(engines.create_engine("chirp", config.engine_options()), slots=4)
    async with connect_client(server) as c:
        assert c.hello["engine"] == "chirp"
        assert_good_stream(await c.speak("A chirp of some length.", "c"), 0.5)
    async with httpx.AsyncClient() as http:
        info = (await http.get(f"{server.http}/v1/info")).json()
    assert {"name": "chirp", "source": "vox-ws-chirp 1.0", "summary": "a tone from another package",
            "available": True, "error": None} in info["engines"]


def test_an_engine_that_cannot_be_served_is_listed_with_why_and_never_stops_the_others(site):
    site("vox-ws-chirp", {"chirp": "chirp_engine:PLUGIN"}, {"chirp_engine": CHIRP})
    site("vox-ws-odd", {"broken": "broken_engine:PLUGIN", "quits": "quitting_engine:PLUGIN",
                        "gone": "no_such_module:PLUGIN", "number": "number_engine:PLUGIN",
                        "misnamed": "chirp_engine:PLUGIN", "piper": "chirp_engine:PLUGIN",
                        "auto": "chirp_engine:PLUGIN"},
         {"broken_engine": "raise RuntimeError('needs a driver that is not installed')\n",
          "quitting_engine": "raise SystemExit(3)\n", "number_engine": "PLUGIN = 42\n"})
    assert {"piper", "voxcpm", "chirp"} == set(engines.plugins())
    assert engines.plugins()["piper"].summary.startswith("Piper (VITS")       # the built-in kept its name
    why = {e.name: e.error for e in engines.installed() if e.source == "vox-ws-odd 1.0"}
    assert why["broken"] == ("broken_engine:PLUGIN failed to import: RuntimeError: needs a driver that is "
                             "not installed")
    assert why["quits"] == "quitting_engine:PLUGIN failed to import: SystemExit: 3"
    assert why["gone"].startswith("no_such_module:PLUGIN failed to import: ModuleNotFoundError")
    assert why["number"] == "number_engine:PLUGIN is a int, not an EnginePlugin"
    assert why["misnamed"] == "chirp_engine:PLUGIN is the engine 'chirp': its entry point must bear its name"
    assert why["piper"] == "its name is taken by the built-in engine"
    assert why["auto"].startswith("'auto' is reserved")
    assert set(engines.unavailable()) == {"broken", "quits", "gone", "number", "misnamed"}
    with pytest.raises(ValueError, match="engine 'broken' is installed but cannot be served: broken_engine:"
                                         "PLUGIN failed to import: RuntimeError: needs a driver"):
        engines.create_engine("broken", {})
    text = serve_help()
    assert "engines installed that cannot be served:\n" in text
    assert "  broken (from vox-ws-odd 1.0): broken_engine:PLUGIN failed to import: RuntimeError" in text


def test_an_engine_whose_setting_is_already_an_option_is_withdrawn_and_refused_by_name(site, capsys):
    from vox_ws.commands.cli import main

    clashing = CHIRP.replace('"chirp"', '"clash"').replace('"chirp-rate"', '"port"')
    echoing = CHIRP.replace('"chirp"', '"echo"')                    # chirp's own setting, --chirp-rate
    site("vox-ws-more", {"chirp": "chirp_engine:PLUGIN", "clash": "clash_engine:PLUGIN",
                         "echo": "echo_engine:PLUGIN"},
         {"chirp_engine": CHIRP, "clash_engine": clashing, "echo_engine": echoing})
    build_parser()
    assert engines.unavailable() == {"clash": "its setting --port is already an option of vox-ws serve",
                                     "echo": "its setting --chirp-rate is already an option of vox-ws serve"}
    assert set(engines.plugins()) == {"piper", "voxcpm", "chirp"}
    assert main(["serve", "--engine", "clash"]) == 2
    assert capsys.readouterr().err.endswith(
        "vox-ws serve: engine 'clash' is installed but cannot be served: its setting --port is already an "
        "option of vox-ws serve\n")
