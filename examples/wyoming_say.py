"""Speak a text over the Wyoming protocol, as Home Assistant does (the server runs with
`vox-ws serve --wyoming tcp://127.0.0.1:10200`), streaming the text in.

    python examples/wyoming_say.py 127.0.0.1 10200 "Hello from Home Assistant." out.wav
"""

import asyncio
import sys
import wave

from wyoming.audio import AudioChunk, AudioStart
from wyoming.client import AsyncTcpClient
from wyoming.tts import SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped


async def main(host: str, port: str, text: str, path: str) -> None:
    pcm, rate = bytearray(), 22050
    async with AsyncTcpClient(host, int(port)) as client:
        await client.write_event(SynthesizeStart().event())
        for word in text.split():
            await client.write_event(SynthesizeChunk(text=word + " ").event())
        await client.write_event(SynthesizeStop().event())
        while True:
            event = await client.read_event()
            if event is None or SynthesizeStopped.is_type(event.type):
                break
            if AudioStart.is_type(event.type):
                rate = AudioStart.from_event(event).rate
            elif AudioChunk.is_type(event.type):
                pcm += AudioChunk.from_event(event).audio
    with wave.open(path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(bytes(pcm))
    print(f"{path}: {len(pcm) / 2 / rate:.2f} s")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
