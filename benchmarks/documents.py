"""A whole document through `vox-ws say --file`: how long it takes and whether memory stays flat.

A server (`vox-ws serve`, default settings) and the `say` client run as processes of their own;
their resident memory (the server with its worker processes) is sampled twice a second over the
run. The document is CHARS characters of varied English prose, many times the server's
`max_text_chars`, so it goes in through one stream's input, a third of the bound at a time.

    python -m benchmarks.documents [--engines piper,voxcpm] [--chars 50000] [--json out.json]

`voxcpm` is the tiny random-weight VoxCPM2, built to stop each segment after `min_len` steps (the
random one would run every sentence to its length cap): the figures are the server's and the
client's work per segment, not the real model's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
import wave

from . import free_port, stop_server
from .attacks import _process_tree, _rss_mb

SUBJECTS = ["The keeper", "A sailor", "The old clock", "Our neighbour", "The river", "A quiet train",
            "The market", "Every lantern", "The teacher", "A small boat"]
VERBS = ["watched", "carried", "remembered", "followed", "painted", "counted", "answered", "crossed"]
OBJECTS = ["the grey harbour", "a letter from the north", "seventeen gulls", "the long road home",
           "the last light of the evening", "a song nobody knew", "the bridge at dawn", "three red doors"]
ENDINGS = [".", ".", ".", "!", "?"]


def document(chars: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    sentences, size = [], 0
    while size < chars:
        sentence = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.4:
            sentence += f", and then {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        sentence += rng.choice(ENDINGS)
        sentences.append(sentence + ("\n\n" if rng.random() < 0.15 else " "))
        size += len(sentences[-1])
    return "".join(sentences)[:chars]


def serve(engine: str, port: int, workdir: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "vox_ws", "serve", "--port", str(port), "--engine", engine,
            "--voice-store", "memory"]
    if engine == "voxcpm":
        from vox_ws.testing.tiny_voxcpm import build

        argv += ["--model", str(build(os.path.join(workdir, "tiny"), stop="always")), "--device", "cpu"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
                if reply.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the {engine} server did not start")
        time.sleep(0.5)


def measure(engine: str, chars: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="vox-ws-documents-") as workdir:
        text = document(chars)
        path = os.path.join(workdir, "book.txt")
        with open(path, "w") as f:
            f.write(text)
        port = free_port()
        server = serve(engine, port, workdir)
        try:
            out, captions = os.path.join(workdir, "book.wav"), os.path.join(workdir, "book.srt")
            started = time.monotonic()
            say = subprocess.Popen([sys.executable, "-m", "vox_ws", "say", "--file", path, "-o", out, "--captions",
                                    captions, "--url", f"ws://127.0.0.1:{port}/v1/stream"],
                                   stderr=subprocess.PIPE, text=True)
            samples = []                      # (seconds, server tree MB, client MB)
            while say.poll() is None:
                samples.append((time.monotonic() - started, sum(_rss_mb(p) for p in _process_tree(server.pid)),
                                _rss_mb(say.pid)))
                time.sleep(0.5)
            wall = time.monotonic() - started
            report = say.stderr.read().strip().splitlines()
            if say.returncode != 0:
                raise RuntimeError(f"say failed ({say.returncode}): {report}")
            with wave.open(out) as w:
                audio_s = w.getnframes() / w.getframerate()
            with open(captions) as f:
                cues = f.read().count(" --> ")
        finally:
            stop_server(server)
    # Memory over the run: the median of its first and last fifths, and the peak.
    fifth = max(1, len(samples) // 5)

    def median(values: list[float]) -> float:
        values = sorted(values)
        return round(values[len(values) // 2], 1)
    return {
        "engine": engine, "chars": len(text), "wall_s": round(wall, 1), "audio_s": round(audio_s, 1),
        "rtf": round(wall / audio_s, 3), "caption_cues": cues,
        "server_rss_mb_first_fifth": median([s[1] for s in samples[:fifth]]),
        "server_rss_mb_last_fifth": median([s[1] for s in samples[-fifth:]]),
        "server_rss_mb_peak": round(max(s[1] for s in samples), 1),
        "client_rss_mb_first_fifth": median([s[2] for s in samples[:fifth]]),
        "client_rss_mb_last_fifth": median([s[2] for s in samples[-fifth:]]),
        "client_rss_mb_peak": round(max(s[2] for s in samples), 1),
        "say_report": report[-1] if report else "",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="piper,voxcpm")
    ap.add_argument("--chars", type=int, default=50_000)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for engine in args.engines.split(","):
        row = measure(engine, args.chars)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
