"""Speak a text through vox-ws as a LiveKit Agents TTS (no LiveKit server needed for this).

    python examples/livekit_say.py ws://127.0.0.1:8765/v1/stream "Hello from LiveKit." out.wav
"""

import asyncio
import sys
import wave

from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

from vox_ws.clients import livekit as vox_ws
from vox_ws.wire import Speech


async def main(url: str, text: str, path: str) -> None:
    tts = vox_ws.TTS(url=url, sample_rate=24000, speech=Speech(word_timestamps=True))
    pcm = bytearray()
    try:
        stream = tts.stream()                          # an LLM's tokens would be pushed as they come
        for word in text.split():
            stream.push_text(word + " ")
        stream.end_input()
        async for audio in stream:
            pcm += bytes(audio.frame.data)
            for word in audio.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []):
                print(f"{word.start_time:6.2f}-{word.end_time:6.2f} {word.strip()}")
    finally:
        await tts.aclose()
    with wave.open(path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(24000)
        f.writeframes(bytes(pcm))
    print(f"{path}: {len(pcm) / 2 / 24000:.2f} s")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
