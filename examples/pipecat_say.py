"""Speak one LLM turn through vox-ws in a Pipecat pipeline and write what reaches the end of it.

    python examples/pipecat_say.py ws://127.0.0.1:8765/v1/stream "Hello from Pipecat." out.wav
"""

import asyncio
import sys
import wave

from pipecat.frames.frames import (
    EndFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.workers.runner import WorkerRunner

from vox_ws.clients.pipecat import VoxWSTTSService


class WavSink(FrameProcessor):
    """Stands where the transport's output would be: keeps the audio, prints the spoken words."""

    def __init__(self) -> None:
        super().__init__()
        self.audio = bytearray()

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio += frame.audio
        elif isinstance(frame, TTSTextFrame):
            print("spoken:", frame.text)
        await self.push_frame(frame, direction)


async def main(url: str, text: str, path: str) -> None:
    sink = WavSink()
    worker = PipelineWorker(Pipeline([VoxWSTTSService(url=url), sink]),
                            params=PipelineParams(audio_out_sample_rate=24000))
    await worker.queue_frames([LLMFullResponseStartFrame(), LLMTextFrame(text), LLMFullResponseEndFrame(),
                               EndFrame()])
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()
    with wave.open(path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(24000)
        f.writeframes(bytes(sink.audio))
    print(f"{path}: {len(sink.audio) / 2 / 24000:.2f} s")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
