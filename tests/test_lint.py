"""The tree passes ruff as pyproject.toml's [tool.ruff] configures it: pyflakes (F: unused imports,
undefined names), pycodestyle (E, W: line length 120 included) and import order (I). ruff comes
with the `test` extra, so a missing ruff fails here rather than skipping."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_tree_passes_ruff():
    assert importlib.util.find_spec("ruff") is not None, "ruff is not installed: pip install -e '.[test]'"
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"ruff check found problems:\n{run.stdout}{run.stderr}"
