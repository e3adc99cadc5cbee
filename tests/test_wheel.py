"""The wheel is the product: built from this tree, installed into a fresh virtual environment
outside it, it must serve the demo page, speak, and say its version, as scripts/serve.sh does."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
import soundfile
import tomllib

import vox_ws
from conftest import checkout_copy, start_serve

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_of_the_tree_is_listed_for_the_wheel():
    """pyproject lists its packages (the demo is mapped in from web/demo): a new folder of code
    that is not listed would be missing from every installed copy."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    in_tree = {".".join(path.relative_to(ROOT).parent.parts) for path in (ROOT / "vox_ws").rglob("*.py")
               if "__pycache__" not in path.parts}
    assert in_tree <= listed, f"add to [tool.setuptools] packages: {sorted(in_tree - listed)}"
    demo = ROOT / "web" / "demo"
    mapped = {name for name in listed if name.startswith("vox_ws.demo")}
    demo_dirs = {"vox_ws.demo" + "".join("." + part for part in path.relative_to(demo).parent.parts)
                 for path in demo.rglob("*") if path.is_file() and "tests" not in path.relative_to(demo).parts}
    assert demo_dirs - {"vox_ws.demo.vendor"} <= mapped, sorted(demo_dirs - mapped)


def test_the_version_has_one_source():
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "vox_ws.__version__"}
    out = subprocess.run([sys.executable, "-m", "vox_ws", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"vox-ws {vox_ws.__version__}"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Built from a copy of the tree: a build in the tree leaves vox_ws.egg-info there, which
    then shadows the installed vox-ws's metadata for every Python started in it."""
    dist = tmp_path_factory.mktemp("dist")
    source = checkout_copy(tmp_path_factory.mktemp("source"))
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(source)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return dist


def test_sdist_and_wheel_pass_twine_check(built):
    files = sorted(built.iterdir())
    assert sorted(f.suffix for f in files) == [".gz", ".whl"], files
    out = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_wheel_carries_the_product_and_no_developer_tooling(built):
    (wheel,) = built.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    demo = sorted(p.relative_to(ROOT / "web" / "demo").as_posix() for p in (ROOT / "web" / "demo").rglob("*")
                  if p.is_file() and p.relative_to(ROOT / "web" / "demo").parts[0] != "tests")
    assert sorted(n.removeprefix("vox_ws/demo/") for n in names if n.startswith("vox_ws/demo/")) == demo
    assert "vox_ws/transports/__init__.py" in names
    assert not [n for n in names if n.startswith(("benchmarks/", "tests/", "vox_ws/bench"))]


def test_an_installed_wheel_serves_the_demo_speaks_and_says_its_version(built, tmp_path):
    """`pip install "vox-ws[piper]"` from the wheel into a fresh venv, run from a directory
    outside the tree: `vox-ws --version`, `vox-ws serve` (the Piper voice, the demo at `/`),
    and `vox-ws say` against it."""
    (wheel,) = built.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", f"{wheel}[piper]"],
                             cwd=tmp_path, env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-4000:]
    where = subprocess.run([str(bin_dir / "python"), "-c", "import vox_ws; print(vox_ws.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert Path(where.strip()).is_relative_to(venv), where

    version = subprocess.run([str(bin_dir / "vox-ws"), "--version"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"vox-ws {vox_ws.__version__}"

    server, port = start_serve([str(bin_dir / "vox-ws"), "serve", "--port", "0",
                                "--voice-store", f"dir:{tmp_path / 'voices'}"],
                               tmp_path / "serve.log", cwd=tmp_path, env=env, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/", timeout=30) as response:
            assert response.read() == (ROOT / "web" / "demo" / "index.html").read_bytes()
        with urllib.request.urlopen(base + "/app.mjs", timeout=30) as response:
            assert response.headers["Content-Type"].startswith("text/javascript")
        wav = tmp_path / "hello.wav"
        said = subprocess.run([str(bin_dir / "vox-ws"), "say", "Hello from the installed wheel.", "-o", str(wav),
                               "--url", f"ws://127.0.0.1:{port}/v1/stream"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert said.returncode == 0, said.stderr
        audio, rate = soundfile.read(str(wav))
        assert rate == 22050 and len(audio) > rate // 2 and float(np.sqrt(np.mean(audio ** 2))) > 0.01
    finally:
        server.terminate()
        server.wait(30)
