"""The `vox-ws` command line as its users read it: `--help` of each command, and
docs/CONFIGURATION.md naming every `serve` option `vox-ws serve --help` lists."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from vox_ws.commands.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def vox_ws(*arguments: str) -> str:
    """What `vox-ws ARGUMENTS` prints."""
    return subprocess.run([sys.executable, "-m", "vox_ws", *arguments], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def serve_options() -> dict[str, str]:
    """Each option `vox-ws serve --help` lists (argparse's own), with its help."""
    commands = next(action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    return {name: action.help or "" for action in commands.choices["serve"]._actions
            for name in action.option_strings if name.startswith("--") and name != "--help"}


def documented_options() -> list[str]:
    """The options the first column of CONFIGURATION.md's table names, once per mention."""
    table = [line for line in (ROOT / "docs" / "CONFIGURATION.md").read_text().splitlines()
             if line.startswith("| `--")]
    return [name for line in table for name in re.findall(r"`(--[a-z0-9-]+)`", line.split("|")[1])]


def test_the_configuration_table_names_every_serve_option_and_no_other():
    """docs/CONFIGURATION.md lacked 10 of the 73 options, this round's among them: an operator
    reading it never learnt of --zeroconf. Every option `serve --help` lists is in the table's
    first column, once, and the table names none the server does not take."""
    listed, documented = set(serve_options()), documented_options()
    assert len(listed) > 70
    assert sorted(listed - set(documented)) == [], "add a row to docs/CONFIGURATION.md"
    assert sorted(set(documented) - listed) == [], "docs/CONFIGURATION.md names options serve does not take"
    twice = sorted({name for name in documented if documented.count(name) > 1})
    assert twice == [], f"documented in two rows: {twice}"


def test_every_serve_option_has_the_environment_variable_the_documentation_promises():
    """CONFIGURATION.md: every option may be set as VOX_WS_<OPTION>; --help says each one's."""
    for option, entry in serve_options().items():
        if option == "--max-batch":                    # --slots's old spelling: VOX_WS_MAX_BATCH is taken too
            continue
        variable = "VOX_WS_" + option[2:].upper().replace("-", "_")
        assert f"[env {variable}" in entry, (option, entry)


def test_the_models_command_is_described_for_both_engines_without_source_paths():
    """`vox-ws --help` called `models` VoxCPM2-only (it fetches Piper voices too), and `models
    --help` cited a source file, which an installed copy's user has no use for."""
    overview = " ".join(vox_ws("--help").split())
    assert "models VoxCPM2 checkpoints and Piper voices" in overview
    models = vox_ws("models", "--help")
    assert "piper:NAME" in models and not re.search(r"\b[\w/]+\.py\b", models), models
