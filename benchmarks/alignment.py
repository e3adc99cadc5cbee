"""The aligner's word times against Piper's own, on the same audio, and how many real-time
streams it keeps up with.

A `vox-ws serve --engine piper --word-timings engine` server speaks 50 fixed English sentences,
one stream each, without Piper's random noise, returning its audio and its own word times (the
model's durations). The aligner (`vox_ws.alignment`, as the server runs it: a `WordAligner` pool
of processes, the segment's audio at 16 kHz) then times the same audio. Figures:

- boundary error: each word's start and end against Piper's, mean / median / p90, and the mean
  signed error of starts and of ends (the bias `alignment/sphinx.py` corrects);
- real-time factor: one process aligning the sentences one after another (seconds of work per
  second of speech), after its decoder is made;
- streams kept up with: every sentence four times at once on a pool of one process per core,
  seconds of speech aligned per second of wall time.

    python -m benchmarks.alignment [--port PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import websockets

from vox_ws import wire
from vox_ws.alignment.pool import SegmentRecording, WordAligner
from vox_ws.alignment.sphinx import END_SHIFT_S, START_SHIFT_S

from . import free_port, stop_server

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "She sells seashells by the seashore every summer.",
    "Our meeting starts at nine thirty tomorrow morning.",
    "Please remember to bring your umbrella, it might rain later.",
    "The museum opened a new exhibit about ancient Egypt.",
    "He paid $3.50 for a cup of coffee downtown.",
    "In 1999 the company moved its offices to Chicago.",
    "Turn left at the second traffic light and keep going.",
    "My grandmother makes the best apple pie in town.",
    "The train to Boston leaves from platform four.",
    "Can you tell me where the nearest pharmacy is?",
    "We watched the sunset from the top of the hill.",
    "Dr. Smith will see you in about fifteen minutes.",
    "The library closes early on Sundays and holidays.",
    "Scientists discovered a new species of frog in the rainforest.",
    "Thank you for calling, how may I help you today?",
    "The children built a sandcastle near the water.",
    "Add two cups of flour and a pinch of salt.",
    "Traffic was heavy on the highway this evening.",
    "Her favorite color has always been deep blue.",
    "The orchestra played a beautiful piece by Mozart.",
    "Don't forget to water the plants while I'm away.",
    "About 40% of the students chose the science track.",
    "The storm knocked out power for several hours.",
    "I would like to order a large pizza with mushrooms.",
    "The old bridge was finally repaired last spring.",
    "Please speak slowly and clearly into the microphone.",
    "Our flight was delayed because of the fog.",
    "The team celebrated their victory with a parade.",
    "He reads the newspaper every morning with breakfast.",
    "A gentle breeze moved through the tall grass.",
    "The software update fixed most of the problems.",
    "You can reach customer support at any hour.",
    "The puppy chased its tail around the kitchen.",
    "We need three volunteers for the weekend cleanup.",
    "The recipe calls for fresh basil and ripe tomatoes.",
    "Mountains covered in snow stretched across the horizon.",
    "She finished the marathon in just under four hours.",
    "The bank will be closed on Monday for the holiday.",
    "Remember that practice makes perfect, so keep trying.",
    "The detective examined every clue very carefully.",
    "A bright rainbow appeared after the afternoon shower.",
    "The store offers a discount to all new members.",
    "Our neighbors adopted two cats from the shelter.",
    "The professor explained the theory with simple examples.",
    "Fresh bread smells wonderful early in the morning.",
    "Please turn off your phones before the show begins.",
    "The river flows gently toward the distant sea.",
    "It took twelve years to build the cathedral.",
    "Good night, and thank you all for listening.",
]
STILL = {"noise_scale": 0.0, "noise_w_scale": 0.0}


async def piper_speech(url: str, text: str) -> tuple[np.ndarray, int, list[tuple[str, float, float]]]:
    """Piper's audio (float, its own rate) and its own word times for one sentence."""
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()
        await ws.send(wire.encode(wire.Start(id="a", text=text, format="s16", word_timestamps=True,
                                             options=STILL)))
        audio, words, rate = [], [], 0
        while True:
            message = wire.read(await ws.recv())
            if isinstance(message, wire.Started):
                rate = message.sample_rate
            elif isinstance(message, wire.AudioChunk):
                audio.append(np.frombuffer(message.audio, "<i2"))
            elif isinstance(message, wire.Words):
                words += [(w["word"], w["start_s"], w["end_s"]) for w in message.words]
            elif isinstance(message, wire.Ended):
                pcm = np.concatenate(audio).astype(np.float32) / 32768
                return pcm, rate, words
            elif isinstance(message, wire.Error):
                raise RuntimeError(message)


def recorded(pcm: np.ndarray, rate: int) -> np.ndarray:
    recording = SegmentRecording(rate)
    recording.add(pcm)
    return recording.take()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    port = args.port or free_port()
    server = subprocess.Popen([sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", str(port),
                               "--word-timings", "engine", "--voice-store", "memory"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"ws://127.0.0.1:{port}/v1/stream"
    try:
        for _ in range(600):
            try:
                asyncio.run(piper_speech(url, "Ready."))
                break
            except (OSError, RuntimeError, websockets.InvalidStatus, websockets.ConnectionClosed):
                time.sleep(0.2)
        spoken = [asyncio.run(piper_speech(url, text)) for text in SENTENCES]
    finally:
        stop_server(server)
    clips = [(recorded(pcm, rate), text, words) for (pcm, rate, words), text in zip(spoken, SENTENCES)]
    speech_s = sum(len(audio) for audio, _, _ in clips) / 16000

    single = WordAligner(workers=1)
    try:
        single.align(clips[0][0], clips[0][1], clips[0][1]).result()          # its decoder made
        started = time.perf_counter()
        aligned = [single.align(audio, text, text).result() for audio, text, _ in clips]
        one_process_s = time.perf_counter() - started
    finally:
        single.close()

    starts, ends, missed, words_n = [], [], 0, 0
    for timed, (_, text, own) in zip(aligned, clips):
        assert [w[0] for w in timed] == [w[0] for w in own] == text.split(), (timed, own)
        for (_, start, end, estimated), (_, own_start, own_end) in zip(timed, own):
            words_n += 1
            missed += estimated
            starts.append(start - own_start)
            ends.append(end - own_end)
    errors = np.abs(np.array(starts + ends)) * 1000

    cores = len(os.sched_getaffinity(0))
    pool = WordAligner(workers=cores, queue=4 * len(clips))      # every clip queued at once
    try:
        pool.start(cores)
        for future in [pool.align(audio, text, text) for audio, text, _ in clips[:cores]]:
            future.result()
        started = time.perf_counter()
        futures = [pool.align(audio, text, text) for _ in range(4) for audio, text, _ in clips]
        for future in futures:
            future.result()
        pool_s = time.perf_counter() - started
    finally:
        pool.close()

    print(f"{len(SENTENCES)} sentences, {words_n} words, {speech_s:.1f} s of Piper speech "
          f"(en_US-joe-medium, noise off); {missed} words estimated")
    print("| boundary error vs Piper's own | mean | median | p90 | start bias | end bias |")
    print("|---|---|---|---|---|---|")
    print(f"| aligner (PocketSphinx 5.1; starts {START_SHIFT_S * 1000:+.0f} ms, ends {END_SHIFT_S * 1000:+.0f} ms) "
          f"| {errors.mean():.0f} ms | {np.median(errors):.0f} ms | "
          f"{np.percentile(errors, 90):.0f} ms | {statistics.mean(starts) * 1000:+.0f} ms | "
          f"{statistics.mean(ends) * 1000:+.0f} ms |")
    print(f"real-time factor, one process: {one_process_s / speech_s:.4f} "
          f"({one_process_s:.2f} s for {speech_s:.1f} s of speech)")
    print(f"{cores} processes ({cores} cores): {4 * speech_s:.1f} s of speech aligned in {pool_s:.2f} s: "
          f"keeps up with {4 * speech_s / pool_s:.0f} real-time streams")


if __name__ == "__main__":
    main()
