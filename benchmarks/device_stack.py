"""The lent GPU machine's Python stack, as the device check meets it: the distributions its image
has, the wheels `scripts/device-wheels.sh` carries to it, and a blocker that makes everything
else unimportable, so that a run on a CPU with every package installed also says whether the
check imports on the device.

    python -m benchmarks.device_stack --wheels            # the wheels' names, for device-wheels.sh
    python -m benchmarks.device_stack --sitecustomize DIR # DIR/sitecustomize.py blocks what the
                                                          # device lacks in every process started
                                                          # with DIR on PYTHONPATH

The blocker wraps each finder of `sys.meta_path`: a module whose distributions are all outside
the device's stack (its image, the wheels, and what they require, by the installed metadata) is
not found, by an import or by `importlib.util.find_spec` alike, as on the device. Modules of no
distribution (the standard library, this tree) are found as usual.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path
from typing import Any

# The image's distributions the check relies on (shared/notes/device-stack.md; the image has more,
# which only ever widens what imports there): Python 3.12.3, torch 2.11.0+cu130, Triton 3.6.0,
# numpy 2.5.2, transformers 5.17.0, huggingface_hub 1.33.0.
DEVICE_HAS = ("torch", "triton", "torchaudio", "numpy", "transformers", "huggingface-hub", "safetensors",
              "tokenizers", "msgpack", "uvloop", "scipy", "scikit-learn", "numba", "einops", "tqdm", "pyyaml",
              "regex", "requests", "psutil", "prometheus-client", "pytest", "pip", "setuptools")

# What the device lacks and the check needs: voxcpm and what it imports (pydantic, librosa, the
# text normaliser), and what vox-ws imports on the engine's path (soxr, soundfile, sentencex,
# websockets), with their own dependencies. `scripts/device-wheels.sh` downloads these.
WHEELS = ("voxcpm", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "librosa", "audioread",
          "decorator", "pooch", "platformdirs", "soundfile", "cffi", "pycparser", "soxr", "inflect",
          "jaraco.functools", "more-itertools", "typeguard", "wetext", "contractions", "textsearch", "anyascii",
          "pyahocorasick", "kaldifst", "sentencex", "websockets")

# This project: its modules import from the tree on the device (PYTHONPATH), never from a wheel.
PROJECT = "vox-ws"


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_distributions() -> set[str]:
    """The device's image and the wheels, closed over what each requires (as the distributions
    installed here declare it; requirements of extras left out), and this project itself (not
    what it requires: that is the question)."""
    from packaging.requirements import Requirement

    wanted = [normalise(n) for n in (*DEVICE_HAS, *WHEELS, *_vendored_by_setuptools())]
    found: set[str] = set()
    while wanted:
        name = wanted.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(normalise(requirement.name))
    return found | {PROJECT}


def _vendored_by_setuptools() -> list[str]:
    """The distributions setuptools vendors, which it takes from site-packages where they are
    installed (inductor imports setuptools to build C++ on a CPU)."""
    try:
        files = importlib.metadata.files("setuptools") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted({part.split("-")[0] for file in files for part in file.parts[2:3]
                   if file.parts[:2] == ("setuptools", "_vendor") and part.endswith(".dist-info")})


def missing_modules() -> frozenset[str]:
    """Top-level modules installed here whose every distribution the device lacks."""
    allowed = device_distributions()
    return frozenset(module for module, dists in importlib.metadata.packages_distributions().items()
                     if not any(normalise(d) in allowed for d in dists))


class _Blocking:
    """One finder of `sys.meta_path`, finding nothing of what the device lacks."""

    def __init__(self, inner: Any, blocked: frozenset[str]) -> None:
        self._inner, self._blocked = inner, blocked

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.partition(".")[0] in self._blocked:
            return None
        find = getattr(self._inner, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def __getattr__(self, name: str) -> Any:      # invalidate_caches, find_distributions, ...
        return getattr(self._inner, name)


def block_missing() -> frozenset[str]:
    """From now on, in this process, what the device lacks cannot be imported; returns it."""
    blocked = missing_modules()
    for module in list(sys.modules):
        if module.partition(".")[0] in blocked:
            del sys.modules[module]
    sys.meta_path[:] = [f if isinstance(f, _Blocking) else _Blocking(f, blocked) for f in sys.meta_path]
    return blocked


def write_sitecustomize(directory: Path) -> Path:
    """DIR/sitecustomize.py, blocking what the device lacks in each Python started with DIR (and
    this tree) on PYTHONPATH: the check's steps and every child they start."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sitecustomize.py"
    path.write_text("# Written by benchmarks.device_stack: as on the lent GPU machine's stack.\n"
                    "from benchmarks.device_stack import block_missing\n\nblock_missing()\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--wheels", action="store_true", help="the wheels' names, one a line")
    group.add_argument("--sitecustomize", help="write DIR/sitecustomize.py")
    group.add_argument("--missing", action="store_true", help="the modules installed here the device lacks")
    args = ap.parse_args(argv)
    if args.wheels:
        print("\n".join(WHEELS))
    elif args.sitecustomize:
        print(write_sitecustomize(Path(args.sitecustomize)))
    else:
        print("\n".join(sorted(missing_modules())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
