"""VoxCPM2 weights and Piper voices on disk: `vox-ws models pull` fetches a checkpoint (or,
`piper:NAME`, a Piper voice: `engines/piper_hub.py`), `vox-ws models list` shows what is here and
whether the engine can load each, `models list --available` the Piper voices that can be pulled
(`engines/piper_catalogue.py`).

The server never downloads to start (it loads from a directory or the local Hugging Face cache,
offline), so a start never waits on a network or fails halfway through a download; with its
admin token, a running server fetches a Piper voice into the folder it serves
(`POST /v1/admin/voices/NAME`). A checkpoint's pull is huggingface_hub's download: resumable,
with a progress bar, honouring `HF_ENDPOINT` (a mirror), `HF_TOKEN` and the hub cache (`HF_HOME`,
`HF_HUB_CACHE`). A Piper voice and the catalogue come through the same client, each file read
no further than the hub said and the server reads, the whole by a deadline, with a progress bar
a file; what the catalogue says is printed as plain text: a hub's escapes never reach the
terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engines.hub_download import Transfer, deadline_for
from ..engines.piper_catalogue import CatalogueNotKept, fetch_catalogue, plain
from ..engines.piper_catalogue import on_disk as catalogue_on_disk
from ..engines.piper_hub import (
    DEFAULT_VOICES_DIR,
    HubUnreachable,
    VoiceRefused,
    default_voices_dir,
    files_of,
    looks_like_voice,
    pull_voice,
    pulled_voices_dir,
)
from ..engines.piper_voices import MAX_CONFIG_BYTES, MAX_MODEL_BYTES, voice_from_spec
from ..engines.voxcpm.loading import DEFAULT_MODEL, read_config

PIPER_PREFIX = "piper:"
# The longest line of a hub's error message printed (a hub writes what it likes there).
MAX_SAID = 500

WEIGHTS = ("model.safetensors", "pytorch_model.bin")
VAE_WEIGHTS = ("audiovae.safetensors", "audiovae.pth")
TOKENIZER = ("tokenizer.json", "tokenizer.model")


@dataclass
class Checkpoint:
    """A checkpoint directory and what keeps the engine from loading it (nothing: it can)."""

    path: Path
    name: str                      # the hub id, or the directory
    revision: str = ""             # the hub commit, for one from the cache
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "path": str(self.path), "revision": self.revision, "ok": self.ok,
                "problems": self.problems}


def check(path: Path) -> list[str]:
    """What keeps the VoxCPM2 engine from loading this directory, in its own words; the weights'
    names are checked against the model at load (`loading.verify_weights`)."""
    problems = []
    try:
        config = read_config(path)
    except FileNotFoundError:
        return ["no config.json"]
    except (OSError, ValueError) as exc:
        return [f"config.json unreadable ({type(exc).__name__}: {exc})"]
    if not isinstance(config, dict):
        return ["config.json is not a JSON object"]
    arch = str(config.get("architecture", "voxcpm")).lower()
    if arch != "voxcpm2":
        problems.append(f"a {arch!r} checkpoint: the batched engine serves VoxCPM2 only")
    for what, names in (("model weights", WEIGHTS), ("audio VAE weights", VAE_WEIGHTS), ("tokenizer", TOKENIZER)):
        present = [name for name in names if (path / name).is_file()]
        if not present:
            problems.append(f"no {what} ({' or '.join(names)})")
        elif present[0].endswith(".safetensors"):
            problems.extend(_safetensors_problems(path / present[0]))
    return problems


def _safetensors_problems(file: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="numpy") as f:
            if not list(f.keys()):
                return [f"{file.name} holds no tensors"]
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file, in any of its ways
        return [f"{file.name} unreadable ({type(exc).__name__}: {exc}); an interrupted pull resumes when run again"]
    return []


def pull(repo: str = DEFAULT_MODEL, revision: str | None = None, directory: str | None = None) -> Path:
    """Download `repo` at `revision` into the hub cache, or into `directory`; returns its path."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id=repo, revision=revision, local_dir=directory))


def on_disk(directories: list[str]) -> list[Checkpoint]:
    """Every checkpoint in the hub cache, and each directory given that is one or holds some."""
    found = []
    try:
        from huggingface_hub import scan_cache_dir

        cache = scan_cache_dir()
    except Exception:  # noqa: BLE001 - no cache yet (CacheNotFound), or one unreadable
        cache = None
    if cache is not None:
        for repo in sorted(cache.repos, key=lambda r: r.repo_id):
            if repo.repo_type != "model":
                continue
            for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
                path = Path(revision.snapshot_path)
                if (path / "config.json").exists():
                    found.append(Checkpoint(path, repo.repo_id, revision.commit_hash, check(path)))
    for directory in directories:
        root = Path(directory).expanduser()
        candidates = [root] if (root / "config.json").exists() else sorted(
            p for p in root.iterdir() if (p / "config.json").exists()) if root.is_dir() else []
        if not candidates:
            found.append(Checkpoint(root, str(root), "", ["no checkpoint here (no config.json)"]))
        found.extend(Checkpoint(p, str(p), "", check(p)) for p in candidates)
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="models_command", required=True)
    get = commands.add_parser("pull", help="download a VoxCPM2 checkpoint, or a Piper voice by name "
                                           "(resumable; HF_ENDPOINT for a mirror)")
    get.add_argument("repo", nargs="?", default=DEFAULT_MODEL,
                     help=f"hub id (default {DEFAULT_MODEL}), or piper:NAME (e.g. piper:en_US-lessac-medium) for a "
                          f"Piper voice, put in {DEFAULT_VOICES_DIR} (or --dir), which the server serves")
    get.add_argument("--revision", help="a branch, tag or commit (default: main)")
    get.add_argument("--dir", help="download into this directory instead of the hub cache (then serve "
                                   "with --model DIR)")
    show = commands.add_parser("list", help="the checkpoints and Piper voices on disk and whether the engine "
                                            "can load each; --available: the Piper voices that can be pulled "
                                            "by name")
    show.add_argument("--dir", action="append", default=[], help="also look here (a checkpoint, or a folder of them)")
    show.add_argument("--json", action="store_true", help="one JSON document")
    show.add_argument("--available", action="store_true",
                      help="the Piper voices catalogue (rhasspy/piper-voices' voices.json, through the hub: "
                           "HF_ENDPOINT for a mirror, its cache when HF_HUB_OFFLINE is set): each voice's "
                           "name, language, quality, speakers, size, and whether it is in the voices folder "
                           "the server serves (VOX_WS_PIPER_VOICES_DIR, else " + DEFAULT_VOICES_DIR + ")")
    show.add_argument("--language", help="with --available: one language's voices (en, or en_GB for one "
                                         "region)")


def main(args: argparse.Namespace) -> int:
    try:
        import huggingface_hub  # noqa: F401 - what pull and list are made of
    except ImportError as exc:
        print(f"vox-ws models: the hub's client is part of the `voxcpm` and `piper` extras ({exc.name} is "
              "missing): pip install '.[piper]' in a checkout, or VOX_WS_EXTRAS=piper scripts/setup.sh",
              file=sys.stderr)
        return 2
    if args.models_command == "pull":
        if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
            print("vox-ws models pull: HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it", file=sys.stderr)
            return 2
        if looks_like_voice(args.repo):
            # A Piper voice's name is no hub checkpoint's: the hub would answer an opaque 401.
            print(f"vox-ws models pull: {args.repo!r} is a Piper voice's name: did you mean "
                  f"{PIPER_PREFIX}{args.repo}?", file=sys.stderr)
            return 2
        return _pull_piper(args) if args.repo.startswith(PIPER_PREFIX) else _pull(args)
    if args.available:
        return _list_available(args)
    if args.language:
        print("vox-ws models list: --language goes with --available", file=sys.stderr)
        return 2
    checkpoints = on_disk(args.dir)
    voices = piper_voices_on_disk()
    if args.json:
        print(json.dumps([c.as_dict() for c in checkpoints] + [v.as_dict() for v in voices], indent=2))
        return 0
    if not checkpoints:
        print(f"no checkpoints on disk (hub cache: {_hub_cache()}); `vox-ws models pull` fetches {DEFAULT_MODEL}")
    for c in checkpoints + voices:
        where = f"{c.name}@{c.revision[:10]}" if c.revision else c.name
        verdict = "ok" if c.ok else "cannot load: " + "; ".join(c.problems)
        print(f"{where}\n    {c.path}\n    {verdict}")
    return 0


def piper_voices_on_disk() -> list[Checkpoint]:
    """The Piper voices in the voices folder pulls fill (each served by its name)."""
    folder = default_voices_dir()
    if folder is None:
        return []
    return [Checkpoint(model, PIPER_PREFIX + model.stem, "", _piper_voice_problems(model))
            for model in sorted(folder.glob("*.onnx"))]


def _piper_voice_problems(model: Path) -> list[str]:
    """What keeps the server from serving a voice file, as it reads the file (a model that
    is plainly none, a config missing, unreadable or over its bound)."""
    try:
        voice_from_spec(f"{model.stem}={model}")
    except ValueError as exc:
        return [str(exc)]
    return []


def _pull_piper(args: argparse.Namespace) -> int:
    name = args.repo[len(PIPER_PREFIX):]
    try:
        files_of(name)
    except ValueError as exc:
        print(f"vox-ws models pull: {exc}", file=sys.stderr)
        return 2
    bars = _ProgressBars()
    try:
        transfer = Transfer(deadline_for(MAX_CONFIG_BYTES + MAX_MODEL_BYTES), progress=bars)
        model = pull_voice(name, args.dir, args.revision, transfer=transfer)
    except VoiceRefused as exc:
        print(f"vox-ws models pull: {args.repo}: refused: {plain(str(exc), MAX_SAID)}", file=sys.stderr)
        return 1
    except HubUnreachable as exc:
        print(f"vox-ws models pull: {args.repo}: {plain(str(exc), MAX_SAID)}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the hub's errors (not found, network) say what went wrong
        print(f"vox-ws models pull: {args.repo}: {type(exc).__name__}: {plain(str(exc), MAX_SAID)}",
              file=sys.stderr)
        return 1
    finally:
        bars.close()
    serve = f"vox-ws serve --piper-voices-dir {model.parent}" if args.dir else "vox-ws serve"
    print(f"{args.repo} is in {model}\nserve it (as voice {name!r}) with: {serve}")
    return 0


def _list_available(args: argparse.Namespace) -> int:
    """`models list --available`: the catalogue, one voice a line (or one JSON document)."""
    folder = pulled_voices_dir()
    try:
        catalogue = fetch_catalogue(folder)
    except HubUnreachable as exc:
        print(f"vox-ws models list --available: {plain(str(exc), MAX_SAID)}", file=sys.stderr)
        return 1
    except CatalogueNotKept as exc:
        print(f"vox-ws models list --available: {exc}: unset HF_HUB_OFFLINE to fetch it", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a catalogue refused, or the hub's own errors: one line
        print(f"vox-ws models list --available: {type(exc).__name__}: {plain(str(exc), MAX_SAID)}",
              file=sys.stderr)
        return 1
    here = catalogue_on_disk(folder)
    voices = catalogue.in_language(args.language)
    if args.json:
        print(json.dumps([{**v.as_dict(), "in_folder": v.name in here} for v in voices], indent=2))
        return 0
    if not voices:
        print(f"no voice in {args.language!r} among the {len(catalogue.voices)} of the catalogue")
        return 0
    width = max(len(v.name) for v in voices)
    for v in voices:
        mark = "  (in the folder)" if v.name in here else ""
        print(f"{v.name:<{width}}  {v.language:<6} {v.language_name:<12} {v.quality:<6} "
              f"{v.speakers:>4} speaker{'s' if v.speakers > 1 else ' '} {v.size_bytes / 1e6:6.1f} MB{mark}")
    print(f"\n{len(voices)} voices; `vox-ws models pull piper:NAME` puts one in {folder}, which the server "
          "serves")
    return 0


class _ProgressBars:
    """A progress bar a file of a Piper voice, as huggingface_hub draws a checkpoint's (its own
    tqdm: none where HF_HUB_DISABLE_PROGRESS_BARS is set)."""

    def __init__(self) -> None:
        self._bars: dict[str, Any] = {}

    def __call__(self, path: str, received: int, size: int | None) -> None:
        from huggingface_hub.utils import tqdm

        bar = self._bars.get(path)
        if bar is None:
            bar = self._bars[path] = tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024,
                                          desc=Path(path).name)
        bar.update(received - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()


def _pull(args: argparse.Namespace) -> int:
    try:
        path = pull(args.repo, args.revision, args.dir)
    except Exception as exc:  # noqa: BLE001 - the hub's errors (not found, gated, network) say what went wrong
        print(f"vox-ws models pull: {args.repo}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    problems = check(path)
    if problems:
        print(f"{args.repo} downloaded to {path}, but the engine cannot load it: {'; '.join(problems)}",
              file=sys.stderr)
        return 1
    serve = "vox-ws serve" if args.dir is None and args.repo == DEFAULT_MODEL and not args.revision else (
        f"vox-ws serve --model {path}" if args.dir or args.revision else f"vox-ws serve --model {args.repo}")
    print(f"{args.repo} is in {path}\nserve it on a GPU with: {serve}")
    return 0


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
