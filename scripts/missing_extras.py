"""Which of vox-ws's extras (pyproject.toml's optional dependencies) this Python lacks.

    .venv/bin/python scripts/missing_extras.py piper,wyoming

Prints one line per extra named that is not installed in full (`EXTRA: REQUIREMENT (why)`) and
exits 1; exits 0, silent, when every one is (vox-ws itself included); exits 2, naming the
extras there are, for a name pyproject.toml has no extra of. `scripts/serve.sh` runs it to know
whether `scripts/setup.sh` has anything to install: it checked `import vox_ws, piper` only, so
`VOX_WS_EXTRAS=piper,wyoming scripts/serve.sh --wyoming ...` installed nothing and failed.

The requirements are read from the checkout's pyproject.toml, not the installed metadata, so a
requirement added since the install counts as missing; each is checked against the installed
distributions (name, version, and the extras it names, one level deep) by `packaging`.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ImportError:                       # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

try:
    from packaging.requirements import Requirement
except ImportError:                       # a bare venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
# What scripts/setup.sh installs for an extra beside its listed requirements (voxcpm without its
# dependencies, torch first and pinned there): without them the extra is not installed either.
INSTALLED_BESIDE = {"voxcpm": ["torch", "voxcpm"]}


def extras_declared(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, list[str]]:
    with pyproject.open("rb") as f:
        return tomllib.load(f)["project"].get("optional-dependencies", {})


def unmet(requirement: str, seen: frozenset[str] = frozenset()) -> str | None:
    """Why `requirement` is not met here (not installed, another version, an extra of it not
    installed), or None."""
    wanted = Requirement(requirement)
    if wanted.marker is not None and not wanted.marker.evaluate({"extra": ""}):
        return None                       # not for this Python or platform
    try:
        version = metadata.version(wanted.name)
    except metadata.PackageNotFoundError:
        return "not installed"
    if wanted.specifier and not wanted.specifier.contains(version, prereleases=True):
        return f"{version} installed"
    for extra in sorted(wanted.extras - seen):
        for inner in metadata.requires(wanted.name) or []:
            marker = Requirement(inner).marker
            wanted_by_extra = marker is not None and marker.evaluate({"extra": extra})
            if wanted_by_extra and not marker.evaluate({"extra": ""}):
                why = unmet(inner.split(";")[0], seen | wanted.extras)
                if why is not None:
                    return f"its extra {extra}: {inner.split(';')[0].strip()} {why}"
    return None


def missing(extras: list[str], declared: dict[str, list[str]]) -> list[tuple[str, str, str]]:
    """(extra, requirement, why) for each requirement of the extras named that is not met; vox-ws
    itself first, as the extra ''."""
    found = []
    try:
        metadata.version("vox-ws")
    except metadata.PackageNotFoundError:
        found.append(("", "vox-ws", "not installed"))
    for extra in extras:
        for requirement in [*declared[extra], *INSTALLED_BESIDE.get(extra, [])]:
            why = unmet(requirement)
            if why is not None:
                found.append((extra, requirement, why))
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: missing_extras.py EXTRA[,EXTRA...]", file=sys.stderr)
        return 2
    extras = [name.strip() for name in argv[0].split(",") if name.strip()]
    declared = extras_declared()
    unknown = [name for name in extras if name not in declared]
    if unknown:
        print(f"VOX_WS_EXTRAS: no extra {unknown[0]!r}; there are: {', '.join(declared)}", file=sys.stderr)
        return 2
    found = missing(extras, declared)
    for extra, requirement, why in found:
        print(f"{extra or 'vox-ws'}: {requirement} ({why})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
