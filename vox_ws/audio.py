"""Audio encoding for the wire: resampling with per-stream state, sample formats, WAV files."""

from __future__ import annotations

import io
import wave

import numpy as np
import soxr

# Sample formats of a stream's audio: 32-bit float, 16-bit signed, 8-bit G.711 mu-law.
FORMATS = ("f32", "s16", "mulaw")


class Gain:
    """A fixed gain that never clips: where the gained audio would pass full scale, the gain
    comes down to what just fits and stays there (a limiter with an instant attack and no
    release, so the loudness never pumps)."""

    def __init__(self, gain: float) -> None:
        self.gain = float(gain)

    def apply(self, pcm: np.ndarray) -> np.ndarray:
        if self.gain == 1.0 or not len(pcm):
            return pcm
        peak = float(np.max(np.abs(pcm)))
        if peak * self.gain > 1.0:
            self.gain = 1.0 / peak
        return (pcm * np.float32(self.gain)).astype(np.float32, copy=False)


class StreamEncoder:
    """Turns a stream's float32 chunks at the engine rate into wire bytes at the client's rate.

    The resampler keeps its filter state across chunks, so chunk boundaries leave no seams;
    `flush()` returns the tail the filter still holds at the end of the stream.
    """

    def __init__(self, in_rate: int, out_rate: int, fmt: str) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self.format = fmt
        self._resampler = (
            soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality="HQ") if in_rate != out_rate else None
        )
        self.bytes_per_sample = bytes_per_sample(fmt)

    def encode(self, pcm: np.ndarray) -> bytes:
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if self._resampler is not None:
            pcm = self._resampler.resample_chunk(pcm, last=False)
        return self._pack(pcm)

    def flush(self) -> bytes:
        if self._resampler is None:
            return b""
        return self._pack(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))

    def _pack(self, pcm: np.ndarray) -> bytes:
        return pcm_to_bytes(pcm, self.format)


def pcm_to_bytes(pcm: np.ndarray, fmt: str) -> bytes:
    """float32 [-1, 1] samples to bytes in the wire format (little-endian PCM, or G.711 mu-law)."""
    if fmt == "f32":
        return np.asarray(pcm, dtype="<f4").tobytes()
    if fmt == "s16":
        return to_int16(pcm).astype("<i2").tobytes()
    if fmt == "mulaw":
        return mulaw_encode(to_int16(pcm)).tobytes()
    raise ValueError(f"unknown format {fmt!r}")


def bytes_to_pcm(data: bytes, fmt: str) -> np.ndarray:
    """Inverse of pcm_to_bytes (for clients and tests)."""
    if fmt == "f32":
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if fmt == "s16":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0
    if fmt == "mulaw":
        return mulaw_decode(np.frombuffer(data, dtype=np.uint8)).astype(np.float32) / 32767.0
    raise ValueError(f"unknown format {fmt!r}")


def bytes_per_sample(fmt: str) -> int:
    return {"f32": 4, "s16": 2, "mulaw": 1}[fmt]


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] to 16-bit samples, clipped and rounded."""
    return (np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0).round().astype(np.int16)


_MULAW_BIAS = 0x84
_MULAW_CLIP = 32635


def mulaw_encode(samples: np.ndarray) -> np.ndarray:
    """16-bit linear PCM to 8-bit G.711 mu-law (the telephony encoding)."""
    x = samples.astype(np.int32)
    sign = np.where(x < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(x), _MULAW_CLIP) + _MULAW_BIAS
    exponent = np.clip(np.floor(np.log2(magnitude)).astype(np.int32) - 7, 0, 7)
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def mulaw_decode(codes: np.ndarray) -> np.ndarray:
    """8-bit G.711 mu-law to 16-bit linear PCM."""
    u = ~codes.astype(np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    magnitude = (((mantissa << 3) + _MULAW_BIAS) << exponent) - _MULAW_BIAS
    return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)


def wav_bytes(pcm: np.ndarray, sample_rate: int) -> bytes:
    """A 16-bit mono WAV file in memory."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm_to_bytes(pcm, "s16"))
    return buf.getvalue()


# Reference audio a server will decode: at most this many channels, rates in this range.
MAX_CHANNELS = 8
MIN_RATE = 8_000
MAX_RATE = 192_000


class AudioTooLong(ValueError):
    """The audio lasts longer than the caller allows."""


def decode_audio_file(data: bytes, max_seconds: float | None = None,
                      target_rate: int | None = None) -> tuple[np.ndarray, int]:
    """WAV/FLAC/OGG bytes to mono float32 samples and their rate (`target_rate` when given).

    A compressed file can expand many thousand times (a FLAC of identical samples), so nothing
    is decoded before the header's channels, rate and length pass the limits, and decoding goes
    one second at a time, mixed down and resampled as it goes: memory stays within about
    `max_seconds` of mono audio plus one block, whatever the file claims. Raises AudioTooLong
    past `max_seconds`, ValueError for anything else wrong."""
    import soundfile

    try:
        source = soundfile.SoundFile(io.BytesIO(data))
    except Exception as exc:  # soundfile raises LibsndfileError, RuntimeError, TypeError...
        raise ValueError(f"audio could not be decoded as WAV, FLAC or OGG ({type(exc).__name__})") from None
    with source:
        rate, channels = int(source.samplerate), int(source.channels)
        if not 1 <= channels <= MAX_CHANNELS:
            raise ValueError(f"audio has {channels} channels; at most {MAX_CHANNELS} are accepted")
        if not MIN_RATE <= rate <= MAX_RATE:
            raise ValueError(f"audio sample rate {rate} Hz is outside {MIN_RATE}-{MAX_RATE} Hz")
        if max_seconds is not None and source.frames > 0 and source.frames / rate > max_seconds:
            raise AudioTooLong(f"audio is {source.frames / rate:.1f}s, over the {max_seconds:g}s allowed")
        out_rate = target_rate or rate
        resampler = soxr.ResampleStream(rate, out_rate, 1, dtype="float32", quality="HQ") if out_rate != rate else None
        limit = None if max_seconds is None else int(max_seconds * rate) + 1
        parts: list[np.ndarray] = []
        decoded = 0
        try:
            for block in source.blocks(blocksize=rate, dtype="float32", always_2d=True):
                decoded += block.shape[0]
                if limit is not None and decoded > limit:
                    raise AudioTooLong(f"audio is over the {max_seconds:g}s allowed")
                mono = block.mean(axis=1, dtype=np.float32)
                parts.append(resampler.resample_chunk(mono) if resampler is not None else mono)
        except AudioTooLong:
            raise
        except Exception as exc:  # noqa: BLE001 - a corrupt stream past a valid header
            raise ValueError(f"audio could not be decoded ({type(exc).__name__})") from None
    if resampler is not None:
        parts.append(resampler.resample_chunk(np.zeros(0, np.float32), last=True))
    if decoded == 0:
        raise ValueError("audio has no samples")
    pcm = np.concatenate(parts).astype(np.float32, copy=False)
    if not np.all(np.isfinite(pcm)):
        raise ValueError("audio has non-finite samples")
    return pcm, out_rate
