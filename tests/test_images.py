"""deploy/Dockerfile.*: images cannot be built on this machine (no container runtime, no image
registry), so each Dockerfile's install steps run here in a fresh virtual environment, as the
image's build would run them, and the installed server starts; and what each image must be (a
compiler for Triton in the CUDA one, the CPU build of torch in the CPU one, not root, a health
check, the volumes the server writes) is read from the file itself."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                            if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip()) for line in text.splitlines()
            if line.strip()]


def build_args(steps: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for kind, rest in steps:
        if kind == "ARG":
            name, _, value = rest.partition("=")
            args[name] = shlex.split(value)[0] if value else ""
    return args


@pytest.mark.parametrize("name", ["cuda", "cpu"])
def test_each_image_runs_as_a_user_with_a_health_check_and_private_cache(name):
    steps = instructions(DEPLOY / f"Dockerfile.{name}")
    kinds = [kind for kind, _ in steps]
    assert steps[0][1].startswith("python:3.12")              # the Python the device and images share
    user = [rest for kind, rest in steps if kind == "USER"]
    assert user and user[-1] not in ("root", "0"), "the server must not run as root"
    assert "HEALTHCHECK" in kinds and "/readyz" in dict(steps)["HEALTHCHECK"]
    # Home Assistant's door too: served and exposed (it ran no Wyoming server, exposed no 10200).
    assert "tcp://0.0.0.0:10200" in dict(steps)["CMD"] and "10200" in dict(steps)["EXPOSE"].split()
    runs = " ".join(rest for kind, rest in steps if kind == "RUN")
    assert "useradd" in runs and "chmod 700 /cache" in runs  # cache_trust reads only a private cache
    assert "VOX_WS_COMPILE_CACHE=/cache/compile" in dict(steps)["ENV"]
    if name == "cuda":
        assert re.search(r"apt-get install[^&]*\bgcc\b", runs), "Triton compiles C at run time"
        assert "--model /models/VoxCPM2" in " ".join(shlex.split(dict(steps)["CMD"].replace(",", " ")))
    else:
        assert '--index-url "$TORCH_INDEX"' in runs and build_args(steps)["TORCH_INDEX"].endswith("/whl/cpu")


def _run_install_steps(name: str, tmp_path: Path, overrides: dict[str, str]) -> Path:
    """The image's COPY and pip steps in a fresh venv (the build's `pip` is the venv's); the
    venv's bin directory."""
    steps = instructions(DEPLOY / f"Dockerfile.{name}")
    args = {**build_args(steps), **overrides}
    app = tmp_path / "app"
    app.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    bin_dir = tmp_path / "venv" / "bin"
    for kind, rest in steps:
        if kind == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                (shutil.copytree if (ROOT / source).is_dir() else shutil.copy)(ROOT / source, app / source)
        elif kind == "RUN" and "pip install" in rest:
            command = rest
            for arg, value in args.items():
                command = command.replace(f'"${arg}"', shlex.quote(value)).replace(f"${arg}", shlex.quote(value))
            # The pip cache this machine already has (the image's --no-cache-dir only keeps it small).
            command = command.replace("--no-cache-dir", "")
            env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
            env.pop("VIRTUAL_ENV", None)
            run = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=app, env=env, capture_output=True,
                                 text=True, timeout=900)
            assert run.returncode == 0, f"{command}\n{run.stderr[-3000:]}"
    return bin_dir


def _installed_server_answers(bin_dir: Path, *args: str) -> str:
    run = subprocess.run([str(bin_dir / "vox-ws"), *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(bin_dir.parent.parent / "hf")})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_the_cpu_image_installs_and_its_server_knows_its_engines(tmp_path):
    # This machine reaches PyPI only: its torch==2.13.0 is the CPU build (the image asks
    # PyTorch's CPU index for the same).
    bin_dir = _run_install_steps("cpu", tmp_path, {"TORCH_INDEX": "https://pypi.org/simple"})
    probe = subprocess.run([str(bin_dir / "python"), "-c",
                            "import torch, piper; from vox_ws.engines.voxcpm.loading import import_voxcpm; "
                            "import_voxcpm(); print(torch.__version__, torch.version.cuda)"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[1] == "None", "the CPU image must not carry a CUDA build of torch"
    assert "--piper-voice" in _installed_server_answers(bin_dir, "serve", "--help")
    assert "no checkpoints on disk" in _installed_server_answers(bin_dir, "models", "list")


def test_the_cuda_images_install_steps_run(tmp_path):
    # torch==2.13.0 here is the CPU build: the CUDA wheel is gigabytes; the rest installs as there.
    bin_dir = _run_install_steps("cuda", tmp_path, {})
    assert "--compile-cache" in _installed_server_answers(bin_dir, "serve", "--help")
    assert "no checkpoints on disk" in _installed_server_answers(bin_dir, "models", "list")
