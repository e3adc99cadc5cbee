"""The compiled step (`--compile`): readiness while it compiles, the graphs kept on disk and a
second start that loads them, what a saved graph refuses, and what `auto` picks. (Its audio
equals the package's: tests/test_voxcpm_equivalence.py.)"""

from __future__ import annotations

import fcntl
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, wait_until
from helpers import BACKGROUND_BOUND_S, speak_through
from vox_ws.engines.voxcpm import parse_buckets, parse_compile
from vox_ws.engines.voxcpm.compiled import buckets_for
from vox_ws.engines.voxcpm.decoder_process import DecoderProcess
from vox_ws.engines.voxcpm.engine import VoxCPMEngine
from vox_ws.engines.voxcpm.graphs import (
    GraphMismatch,
    GraphMissing,
    GraphsBySize,
    GraphStore,
    PrecompileUnavailable,
)

# The full lane runs these, not the quick one: together they took a minute or more of it (CONTRIBUTING.md, "Tests").
pytestmark = pytest.mark.slow


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
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, compile="auto")
    engine.load()
    try:
        assert engine.compiled is None and engine.runner.compiled is None
        assert engine.describe()["compile"] == {"mode": "auto", "compiled": False, "precompile": None,
                                                "cuda_graphs": None, "mismatched": {}, "attention": None,
                                                "buckets": [],
                                                "compile_s": {}, "graphs": {"loaded": 0, "compiled": 0}}
    finally:
        engine.close()


@pytest.mark.slow
async def test_readyz_says_compiling_until_the_step_is_compiled_then_it_serves(start_server, tiny_model, tmp_path):
    """The compile waits for the test (so "compiling" is seen whatever the machine's speed),
    then compiles one bucket into the given cache. The engine's phase crosses the boundary as
    its host's report thread sees it (`State.loading_phase`, every `REPORT_EVERY_S`): the test
    waits for the server's view of the engine to hold it, then reads what the server answers."""
    entered, release = threading.Event(), threading.Event()

    class HeldCompile(VoxCPMEngine):
        def _compile_step(self, model):
            self.loading_phase = "compiling"
            entered.set()
            assert release.wait(WAIT_TIMEOUT)
            super()._compile_step(model)

    cache = tmp_path / "cache"
    engine = HeldCompile(model=str(tiny_model), device="cpu", slots=1, compile="on", compile_buckets=(1,),
                         compile_cache=str(cache))
    server = start_server(engine, wait=False, slots=1)
    try:
        assert entered.wait(WAIT_TIMEOUT)
        (proxy,) = server.devices.loops
        await wait_until(lambda: proxy.engine.loading_phase == "compiling")
        status, body = server.get("/readyz")
        assert status == 503 and body["status"] == "compiling", body
        async with connect_client(server) as c:
            assert c.hello["status"] == "compiling"
            await c.send({"type": "start", "id": "early", "text": "Too soon."})
            refused = await c.error("early")
            assert refused["code"] == "not_ready" and "compiling" in refused["message"], refused
    finally:
        release.set()                  # a failure above still lets the engine load, and stop
    server.wait_ready()
    status, info = server.get("/v1/info")
    assert info["compile"]["compiled"] is True and info["compile"]["buckets"] == [1], info["compile"]
    # The CFM velocity, the advance and the VAE decode, each compiled once: where a decoder process
    # decodes too, it compiles the decode and this process loads that graph.
    loaded = 1 if engine.runner.decodes_in_process else 0
    assert info["compile"]["graphs"] == {"compiled": 3, "loaded": loaded}, info["compile"]
    assert len(list((cache / "graphs").glob("*.pt2"))) == 3
    async with connect_client(server) as c:
        assert_good_stream(await c.speak("Compiled now.", options={"seed": 1, "max_len": 3}), reason="max_len")


def _speak(engine: VoxCPMEngine) -> np.ndarray:
    return speak_through(engine.runner, "A second start says the same.", seed=3, min_len=2, max_len=6)


@pytest.mark.slow
def test_a_second_start_loads_every_compiled_graph_from_the_disk_and_says_the_same(tiny_model, tmp_path):
    def start() -> VoxCPMEngine:
        engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2, compile="on", compile_buckets=(2,),
                              compile_cache=str(tmp_path / "cache"))
        engine.load()
        return engine

    first = start()
    try:
        made = first.describe()["compile"]["graphs"]
        in_process = first.runner.decodes_in_process
        said = _speak(first)
    finally:
        first.close()
    # Velocity, advance, decode; the decoder process, where there is one, loads the decode too.
    assert made == {"compiled": 3, "loaded": 1 if in_process else 0}, made
    second = start()
    try:
        assert second.describe()["compile"]["graphs"] == {"loaded": 4 if in_process else 3, "compiled": 0}
        again = _speak(second)
    finally:
        second.close()
    assert said.shape == again.shape and said.shape[0] > 0
    np.testing.assert_allclose(again, said, atol=1e-6)


def _affine(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(layer(x)) * 2


@pytest.mark.slow
def test_a_saved_graph_takes_new_weights_refuses_other_shapes_and_a_broken_file_is_compiled_again(tmp_path, caplog):
    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    store = GraphStore(tmp_path)
    graph = store.graph("affine", _affine, (layer, x), context="test")
    assert (store.loaded, store.compiled) == (0, 1)
    torch.testing.assert_close(graph(layer, x), _affine(layer, x))
    for wrong in (torch.randn(3, 4), torch.randn(2, 4, dtype=torch.float64), torch.randn(4, 2).t()):
        with pytest.raises(GraphMismatch, match="affine: argument 1"):
            graph(layer, wrong)

    # Read back by a new store (a new start): the weights are inputs, not baked in.
    again = GraphStore(tmp_path)
    loaded = again.graph("affine", _affine, (layer, x), context="test")
    assert (again.loaded, again.compiled) == (1, 0)
    retrained = torch.nn.Linear(4, 3)
    torch.testing.assert_close(loaded(retrained, x), _affine(retrained, x))
    # Other shapes of the module, or another context: another graph, compiled.
    wider = GraphStore(tmp_path)
    wider.graph("affine", _affine, (torch.nn.Linear(4, 5), x), context="test")
    other = GraphStore(tmp_path)
    other.graph("affine", _affine, (layer, x), context="another model")
    assert (wider.compiled, other.compiled) == (1, 1)
    assert len(list((tmp_path / "graphs").glob("affine-*.pt2"))) == 3

    for saved in (tmp_path / "graphs").glob("affine-*.pt2"):
        saved.write_bytes(b"not a graph")
    fresh = GraphStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="vox_ws.engines.voxcpm"):
        rebuilt = fresh.graph("affine", _affine, (layer, x), context="test")
    assert (fresh.loaded, fresh.compiled) == (0, 1) and "unreadable" in caplog.text
    torch.testing.assert_close(rebuilt(layer, x), _affine(layer, x))


@pytest.mark.slow
async def test_a_graph_another_process_is_compiling_is_waited_for_and_loaded(tmp_path):
    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    GraphStore(tmp_path).graph("affine", _affine, (layer, x), context="test")
    [saved] = (tmp_path / "graphs").glob("affine-*.pt2")
    compiled = saved.read_bytes()
    saved.unlink()                                  # as it is while another process compiles it
    lock = saved.with_suffix(".lock")
    store, made = GraphStore(tmp_path), []
    with open(lock, "a+b") as other:
        fcntl.flock(other, fcntl.LOCK_EX)           # that process holds the graph's lock
        waiter = threading.Thread(target=lambda: made.append(store.graph("affine", _affine, (layer, x),
                                                                            context="test")))
        waiter.start()
        await wait_until(lambda: store.waiting_on == lock)
        saved.write_bytes(compiled)                 # it saves the graph, then lets the lock go
        fcntl.flock(other, fcntl.LOCK_UN)
    waiter.join(WAIT_TIMEOUT)
    assert (store.loaded, store.compiled) == (1, 0)
    torch.testing.assert_close(made[0](layer, x), _affine(layer, x))


@pytest.mark.slow
def test_a_lock_held_past_its_bound_is_compiled_through_and_a_save_is_whole_or_absent(tmp_path, caplog):
    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    store = GraphStore(tmp_path, lock_wait_s=0.2)
    path = store.path("affine", "test", (layer, x), {})
    with open(path.with_suffix(".lock"), "a+b") as other:
        fcntl.flock(other, fcntl.LOCK_EX)           # a holder that never lets it go
        graph = store.graph("affine", _affine, (layer, x), context="test")
        fcntl.flock(other, fcntl.LOCK_UN)
    assert (store.loaded, store.compiled) == (0, 1) and "compiling without it" in caplog.text
    torch.testing.assert_close(graph(layer, x), _affine(layer, x))
    # Saved under a temporary name and renamed: nothing but the whole file is left.
    assert sorted(p.name for p in (tmp_path / "graphs").iterdir() if p.suffix != ".lock") == [path.name]
    # A store that only loads refuses what is not there, and loads what is.
    with pytest.raises(GraphMissing):
        GraphStore(tmp_path, load_only=True).graph("affine", _affine, (layer, torch.randn(3, 4)), context="test")
    loading = GraphStore(tmp_path, load_only=True)
    loading.graph("affine", _affine, (layer, x), context="test")
    assert (loading.loaded, loading.compiled) == (1, 0) and loading.seconds[0][:2] == ("affine:2", "loaded")


@pytest.mark.slow
def test_a_graph_per_batch_size_and_a_dynamic_size_takes_any_length_of_two_or_more(tmp_path):
    def scaled_sum(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return (x[:, :keys.shape[0]] * keys).sum(-1)

    x, keys = torch.randn(2, 16), torch.arange(4.0)
    store = GraphStore(tmp_path)
    graphs = GraphsBySize(store, "scaled_sum", scaled_sum, context="test", rows_of="x", dynamic={"keys": 0})
    for rows, length in ((2, 2), (2, 4), (3, 9), (2, 16), (3, 2)):
        x, keys = torch.randn(rows, 16), torch.arange(float(length))
        torch.testing.assert_close(graphs(x, keys), scaled_sum(x, keys))
    assert (store.loaded, store.compiled) == (0, 2)       # a graph per batch size, not per length
    with pytest.raises(GraphMismatch):
        graphs(x, torch.arange(1.0))


@pytest.mark.slow
def test_a_symbolic_batch_is_one_graph_for_every_batch_of_two_or_more_and_its_own_key(tmp_path):
    """A symbolic batch (`dynamic` names the rows' first size): a batch of 1 has its own graph
    (dynamo specialises a size of 1), every other batch shares one, whose file is not a per-batch
    graph's: a cache of per-batch graphs is never taken for it, nor it for them."""
    def scaled_sum(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return (x[:, :keys.shape[0]] * keys).sum(-1)

    store = GraphStore(tmp_path)
    graphs = GraphsBySize(store, "scaled_sum", scaled_sum, context="test", rows_of="x",
                          dynamic={"keys": 0, "x": 0})
    for rows, length in ((1, 2), (2, 4), (4, 9), (64, 3), (1, 5), (3, 2)):
        x, keys = torch.randn(rows, 16), torch.arange(float(length))
        torch.testing.assert_close(graphs(x, keys), scaled_sum(x, keys))
    assert (store.loaded, store.compiled) == (0, 2)       # batch 1, and every other batch
    per_batch = GraphStore(tmp_path)
    GraphsBySize(per_batch, "scaled_sum", scaled_sum, context="test", rows_of="x", dynamic={"keys": 0})(
        torch.randn(4, 16), torch.arange(3.0))
    assert (per_batch.loaded, per_batch.compiled) == (0, 1)   # not the symbolic graph of the same batch
    again = GraphStore(tmp_path, load_only=True)
    symbolic = GraphsBySize(again, "scaled_sum", scaled_sum, context="test", rows_of="x",
                            dynamic={"keys": 0, "x": 0})
    x, keys = torch.randn(8, 16), torch.arange(6.0)
    torch.testing.assert_close(symbolic(x, keys), scaled_sum(x, keys))
    assert (again.loaded, again.compiled) == (1, 0)


@pytest.mark.slow
def test_a_batch_that_compiles_specialised_after_all_falls_back_to_a_graph_per_batch_size(tmp_path, caplog):
    """A convolution whose groups grow with the rows (as the CPU's folded VAE's do) makes the
    compiler specialise the batch: the symbolic graph refuses any other, so the next batch gets
    a graph of its own, with a warning, and the right result."""
    def folded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows, channels = x.shape[0], x.shape[1]
        out = torch.nn.functional.conv1d(x.reshape(1, rows * channels, -1), weight.repeat(rows, 1, 1),
                                         groups=rows * channels)
        return out.view(rows, channels, -1)

    store = GraphStore(tmp_path)
    graphs = GraphsBySize(store, "folded", folded, context="test", rows_of="x", dynamic={"x": 0})
    weight = torch.randn(4, 1, 3)
    for rows in (2, 3, 4):
        x = torch.randn(rows, 4, 16)
        torch.testing.assert_close(graphs(x, weight), folded(x, weight))
    assert "not symbolic in its batch" in caplog.text and store.compiled == 3   # 2 (as symbolic), 3, 4


def test_a_symbolic_batch_that_does_not_compile_falls_back_to_a_graph_per_batch_size(tmp_path, caplog):
    """A compiler that needs the batch as a number (as the CPU's FlexAttention kernel does) fails
    on the symbolic graph: each batch size then gets a graph of its own, with a warning, and the
    right result; a size the symbolic graph served is never tried again."""
    @torch.library.custom_op("vox_ws_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x.shape[0], torch.SymInt):
            raise NotImplementedError("this kernel takes no symbolic batch")
        return torch.empty_like(x)

    def picky(x: torch.Tensor) -> torch.Tensor:
        return twice(x)

    store = GraphStore(tmp_path)
    graphs = GraphsBySize(store, "picky", picky, context="test", rows_of="x", dynamic={"x": 0})
    for rows in (2, 3, 2):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(graphs(x), x * 2)
    assert "not symbolic in its batch" in caplog.text
    assert store.compiled == 3          # the symbolic attempt, then 2 and 3 each its own


def test_a_decode_compile_that_fails_is_refused_with_its_reason_and_the_process_goes_on(tiny_model, tmp_path):
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1)
    engine.load()
    vae = engine.tts.tts_model.audio_vae
    decoder = DecoderProcess(threads=1)
    decoder.load_vae(type(vae), engine.tts.tts_model.config.audio_vae_config, vae.state_dict(), slots=1,
                     rows_per_call=8, warm_up=(4, 1))
    try:
        decoder.wait_ready()
        decoder.compile((), str(tmp_path), 4)               # no bucket to compile for
        with pytest.raises(RuntimeError, match="compiling the VAE decode failed: ValueError"):
            decoder.wait_compiled()
        latents = torch.zeros(1, vae.latent_dim, 4)
        audio = decoder.wait(decoder.submit(latents, [0]))
        assert audio.shape[0] == 1 and audio.shape[1] > 0 and np.isfinite(audio).all()
    finally:
        decoder.close()
        engine.close()


# ------------------------------------------------------------------------------ a cache is code


class _Planted:
    """A pickle that, read back, makes a directory: proof that loading a file ran its code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.mkdir, (str(self.marker),))


def _plant(cache: Path, marker: Path, layer, x) -> Path:
    """The file a store in `cache` would load for the `affine` graph, holding `_Planted`."""
    import pickle

    path = GraphStore(cache).path("affine", "test", (layer, x), {})
    path.write_bytes(pickle.dumps(_Planted(marker)))
    return path


@pytest.mark.slow
def test_a_cache_that_others_could_write_is_never_read(tmp_path, caplog):
    import os

    from vox_ws.engines.voxcpm.cache_trust import trusted_cache_dir

    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    # A private cache is read: the planted file ran (this is what the check keeps out).
    private = tmp_path / "private" / "cache"
    assert trusted_cache_dir(private) == private and (private.stat().st_mode & 0o777) == 0o700
    assert (private.parent.stat().st_mode & 0o777) == 0o700          # missing parents made private too
    _plant(private, tmp_path / "ran-private", layer, x)
    GraphStore(trusted_cache_dir(private)).graph("affine", _affine, (layer, x), context="test")
    assert (tmp_path / "ran-private").exists()

    # Others may write it (mode 0777, as a shared /tmp path or umask 000 gives): not read, not
    # repaired; the step compiles into a private directory of its own, and says why.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    planted = _plant(shared, tmp_path / "ran-shared", layer, x)
    with caplog.at_level(logging.WARNING, logger="vox_ws.engines.voxcpm"):
        used = trusted_cache_dir(shared)
    assert used != shared and (used.stat().st_mode & 0o777) == 0o700 and "may be written by others" in caplog.text
    store = GraphStore(used)
    graph = store.graph("affine", _affine, (layer, x), context="test")
    assert not (tmp_path / "ran-shared").exists() and (store.loaded, store.compiled) == (0, 1)
    torch.testing.assert_close(graph(layer, x), _affine(layer, x))
    assert planted.exists() and (shared.stat().st_mode & 0o777) == 0o777          # left as it was

    # A parent anyone may write (no sticky bit): the cache could be swapped for another.
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    assert trusted_cache_dir(tmp_path / "open" / "cache") != tmp_path / "open" / "cache"
    # A link to a private cache: where it points may change under the server.
    (tmp_path / "link").symlink_to(private)
    assert trusted_cache_dir(tmp_path / "link") != tmp_path / "link"
    # An entry others may write in a directory they can enter.
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    os.chmod(readable, 0o755)
    (readable / "graphs").mkdir()
    os.chmod(readable / "graphs", 0o777)
    assert trusted_cache_dir(readable) != readable


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0,
                    reason="planting another user's file needs root (CI runs as root)")
def test_another_users_cache_or_planted_file_is_never_unpickled(tmp_path):
    import os

    from vox_ws.engines.voxcpm.cache_trust import trusted_cache_dir, why_untrusted

    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    other_uid = 4242
    theirs = tmp_path / "theirs"                          # their directory, private to them
    theirs.mkdir(mode=0o700)
    _plant(theirs, tmp_path / "ran", layer, x)
    os.chown(theirs, other_uid, other_uid)
    assert "owned by uid 4242" in why_untrusted(theirs)
    # A private cache of ours with their file planted in it (while it was open, say).
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    planted = _plant(ours, tmp_path / "ran", layer, x)
    os.chown(planted, other_uid, other_uid)
    assert f"{planted} is owned by uid 4242" in why_untrusted(ours)
    for cache in (theirs, ours):
        used = trusted_cache_dir(cache)
        # Another directory (this process's one fallback), holding nothing of theirs: loading
        # the graph their file poses as never runs it.
        assert used != cache and all(p.stat().st_uid == os.geteuid() for p in used.rglob("*"))
        GraphStore(used).graph("affine", _affine, (layer, x), context="test")
    assert not (tmp_path / "ran").exists()


def test_precompile_is_switched_on_where_torch_keeps_it_behind_a_flag(tmp_path):
    """torch 2.11 has `enable_aot_compile` off by default: the store turns it on, so graphs are
    saved and loaded (the flag off, a store silently saved nothing)."""
    config = torch._dynamo.config
    if not hasattr(config, "enable_aot_compile"):
        pytest.skip("this torch keeps no precompile flag")
    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    with config.patch(enable_aot_compile=False):          # as torch 2.11 comes
        store = GraphStore(tmp_path)
        assert store.precompile and config.enable_aot_compile
        store.graph("affine", _affine, (layer, x), context="test")
    assert list((tmp_path / "graphs").glob("affine-*.pt2"))
    with config.patch(enable_aot_compile=False):
        again = GraphStore(tmp_path, load_only=True)
        again.graph("affine", _affine, (layer, x), context="test")
    assert (again.loaded, again.compiled) == (1, 0)


def test_without_precompile_a_load_only_store_refuses_and_the_engine_serves_eager(tiny_model, tmp_path,
                                                                                   monkeypatch, caplog):
    """A torch that cannot load saved graphs: the serving side never compiles on its own thread;
    it stays eager, says why, and /v1/info says graphs are not kept."""
    from vox_ws.engines.voxcpm import graphs

    monkeypatch.setattr(graphs, "precompile_available", lambda: False)
    with pytest.raises(PrecompileUnavailable, match="cannot load saved graphs"):
        GraphStore(tmp_path / "store", load_only=True)
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, compile="on", compile_buckets=(1,),
                          compile_cache=str(tmp_path / "cache"), compile_wait=False)
    with caplog.at_level(logging.WARNING, logger="vox_ws.engines.voxcpm"):
        engine.load()
    try:
        info = engine.describe()["compile"]
        assert engine.background is None and engine.compiled is None
        assert info["precompile"] is False and info["compiled"] is False and "background" not in info
        assert "serving eager" in caplog.text and "cannot load saved graphs" in caplog.text
        assert _speak(engine).shape[0] > 0
    finally:
        engine.close()


def test_a_graphs_key_names_the_cuda_and_triton_versions_and_the_gpu_it_was_built_for(tmp_path):
    from vox_ws.engines.voxcpm import graphs

    assert f"cuda {torch.version.cuda} triton " in graphs._versions()
    layer, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    assert graphs._device_architecture((layer, x, [x])) == ""          # a CPU's graphs: no GPU in the key
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        assert graphs._device_architecture((x.cuda(),)).endswith(f"sm_{major}{minor}")


@pytest.mark.slow
def test_vox_ws_compile_fills_a_cache_that_a_later_serve_loads_without_compiling(tiny_model, tmp_path):
    """`vox-ws compile` with serve's options compiles every graph into the cache and exits; the
    server started after it with the same options loads each graph (none compiled there)."""
    import json
    import subprocess
    import sys
    import urllib.request

    from conftest import start_serve

    options = ["--engine", "voxcpm", "--model", str(tiny_model), "--device", "cpu", "--slots", "1",
               "--compile-cache", str(tmp_path / "cache")]
    ahead = subprocess.run([sys.executable, "-m", "vox_ws", "compile", *options], capture_output=True, text=True,
                           timeout=BACKGROUND_BOUND_S)
    assert ahead.returncode == 0, ahead.stderr[-3000:]
    assert "the step for [1] rows" in ahead.stdout and "3 graphs compiled" in ahead.stdout, ahead.stdout
    proc, port = start_serve([sys.executable, "-m", "vox_ws", "serve", "--port", "0", *options, "--compile", "on",
                              "--compile-wait", "true"], tmp_path / "serve.log")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/info", timeout=30) as response:
            info = json.load(response)
    finally:
        proc.terminate()
        proc.wait(30)
    compiled = info["compile"]
    assert compiled["buckets"] == [1] and compiled["precompile"] is True, compiled
    assert compiled["graphs"]["compiled"] == 0 and compiled["graphs"]["loaded"] >= 2, compiled


def test_vox_ws_compile_refuses_what_has_nothing_to_compile():
    import subprocess
    import sys

    for options, said in ((["--engine", "piper"], "has no compiled step"),
                          (["--engine", "voxcpm", "--compile", "off"], "nothing to compile")):
        run = subprocess.run([sys.executable, "-m", "vox_ws", "compile", *options], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 2 and said in run.stderr, run.stderr


def test_cuda_graphs_are_refused_where_they_cannot_be_had(tiny_model):
    """`--cuda-graphs` replays the compiled whole step on a CUDA device: refused, with what it
    needs, without the compiled step, with LoRA slots, or on another device (measured on a GPU by
    `benchmarks.device_check`, which compares its audio with the eager step's)."""
    from vox_ws.engines.voxcpm.cuda_graphs import CudaCapture

    with pytest.raises(ValueError, match="needs --compile on or auto"):
        VoxCPMEngine(model=str(tiny_model), device="cpu", compile="off", cuda_graphs=True)
    with pytest.raises(ValueError, match="LoRA"):
        VoxCPMEngine(model=str(tiny_model), device="cpu", compile="on", lora_rank=4, cuda_graphs=True)
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, compile="on", cuda_graphs=True)
    try:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            engine.load()
    finally:
        engine.close()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CudaCapture(torch.device("cpu"))


def test_a_compile_cache_that_may_not_be_used_falls_back_to_one_private_directory_removed_at_exit(tmp_path):
    """An untrusted --compile-cache: every ask of the process gets the same private directory
    (its children are handed it), and it is gone once the process has exited."""
    import os
    import subprocess
    import sys

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    code = ("from pathlib import Path; from vox_ws.engines.voxcpm.cache_trust import trusted_cache_dir; "
            f"a = trusted_cache_dir(Path({str(shared)!r})); b = trusted_cache_dir(Path({str(shared)!r})); "
            "assert a == b and a.is_dir() and trusted_cache_dir(a) == a; print(a)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    used = Path(run.stdout.strip())
    assert used != shared and not used.exists()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0,
                    reason="planting another user's directory needs root (CI runs as root)")
def test_the_compiler_never_touches_a_shared_temporary_directory_another_user_made_first(tiny_model, tmp_path):
    """Inductor's default cache is $TMPDIR/torchinductor_<user>, which another local user can
    make first and fill with a library its CPU probe would load. A server compiling the step
    (in this process and in its decoder process) points inductor at its private cache before
    anything warms the compiler: the planted directory is never written or read."""
    import getpass
    import os
    import subprocess
    import sys

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    os.chmod(temporary, 0o1777)
    planted = temporary / f"torchinductor_{getpass.getuser()}"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    os.chmod(planted, 0o777)
    before = planted.stat().st_atime_ns
    code = ("from vox_ws.engines.voxcpm.engine import VoxCPMEngine; "
            f"e = VoxCPMEngine(model={str(tiny_model)!r}, device='cpu', slots=1, compile='on', "
            f"compile_buckets=(1,), compile_cache={str(tmp_path / 'cache')!r}); e.load(); "
            "print(e.describe()['compile']['graphs']); e.close()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=BACKGROUND_BOUND_S,
                         env={**os.environ, "TMPDIR": str(temporary)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'compiled': 3" in run.stdout or "'compiled': 4" in run.stdout, run.stdout
    assert planted.stat().st_atime_ns == before          # never listed (where atimes are kept) ...
    assert list(planted.iterdir()) == []                 # ... nor written
    assert not [p for p in temporary.iterdir() if p.name.startswith("torchinductor") and p != planted]
    # Where inductor keeps its precompiled headers whatever its cache directory (a private part
    # of torch this relies on: renamed, this says so).
    from torch._inductor import codecache

    assert hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR")

