"""The demo's JavaScript units (resampler, WAV encoder, the player worklet) under Node's own test runner."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_demo_javascript_units():
    result = subprocess.run(["node", "--test", "web/demo/tests/"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# fail 0" in result.stdout
