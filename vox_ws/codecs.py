"""Compressed audio and speed change for the wire, through PyAV (FFmpeg's libraries).

An `OutputPipeline` takes a stream's float32 PCM at its output rate, chunk by chunk, and
returns wire bytes: time-stretched first when a speed is asked for (FFmpeg's `atempo`, which
keeps the pitch), then encoded. Every object here keeps its state across chunks, so joins leave
no seams, and every call is synchronous: callers run it off the event loop.

Containers are muxed by FFmpeg into a sink that the pipeline empties after every call, so the
concatenation of what the calls return is one valid file, and a player can start on the first
piece. The sink is seekable, so a muxer that learns the file's length only at its end goes back
and writes it (FLAC's STREAMINFO: total samples and MD5; WAV's RIFF and data sizes): bytes sent
already cannot change, so those writes come back as `rewrites` with the last piece, for whoever
holds the whole file (a whole response, a file on disk). `opus_packets` skips the container:
each call returns raw Opus packets for WebCodecs.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from .audio import FORMATS as PCM_FORMATS  # packed on the engine loop's thread when the speed is 1
from .audio import pcm_to_bytes, to_int16

# A page of Ogg at most this long (µs): FFmpeg's default of 1 s would hold the audio back. A
# page costs 27 bytes and more, so much shorter pages cost bit rate.
OGG_PAGE_US = 40_000

# Speeds a pipeline accepts; FFmpeg's atempo takes 0.5-2.0 per instance, so they are chained.
MIN_SPEED = 0.25
MAX_SPEED = 4.0


@dataclass(frozen=True)
class Codec:
    """One compressed output format."""

    name: str
    encoder: str                      # FFmpeg encoder
    sample_format: str                # what the encoder is fed
    container: str | None             # FFmpeg muxer; None: raw packets
    content_type: str
    rates: tuple[int, ...] | None     # rates the encoder takes (None: any)
    bit_rate: int | None = None
    # True: a decoder yields whole frames, the encoder's priming and the last frame's padding
    # included (MP3, AAC, raw Opus packets); False: exactly the samples fed (Ogg Opus trims by
    # pre-skip and granule position; FLAC and WAV are lossless).
    whole_frames: bool = False
    container_options: dict[str, str] = field(default_factory=dict)
    encoder_options: dict[str, str] = field(default_factory=dict)

    def default_rate(self, source_rate: int) -> int:
        if self.rates is None or source_rate in self.rates:
            return source_rate
        return max(self.rates)

    def takes_rate(self, rate: int) -> bool:
        return self.rates is None or rate in self.rates


_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_MPEG_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
_AAC_RATES = _MPEG_RATES + (64000, 88200, 96000)

# Encoder settings for speech, chosen so that one stream encodes well over 50 times faster than
# real time on one core (docs/PERFORMANCE.md): Opus in its speech mode at complexity 7 (the
# default 10 costs 2.5 times the CPU for no audible gain at this rate; below 7 it stops
# analysing and needs more bits), LAME's quality 7, FFmpeg AAC's fast coder.
_OPUS_SPEECH = {"application": "voip", "compression_level": "7"}

CODECS: dict[str, Codec] = {c.name: c for c in (
    # 24 kbit/s mono is clear speech, and (with the Ogg pages) 1/25 of s16 at 48 kHz.
    Codec("opus", "libopus", "flt", "ogg", "audio/ogg; codecs=opus", _OPUS_RATES, 24_000,
          container_options={"page_duration": str(OGG_PAGE_US)}, encoder_options=_OPUS_SPEECH),
    Codec("opus_packets", "libopus", "flt", None, "audio/opus", _OPUS_RATES, 24_000, whole_frames=True,
          encoder_options=_OPUS_SPEECH),
    Codec("mp3", "libmp3lame", "fltp", "mp3", "audio/mpeg", _MPEG_RATES, 64_000, whole_frames=True,
          container_options={"write_xing": "0", "id3v2_version": "0"}, encoder_options={"compression_level": "7"}),
    Codec("aac", "aac", "fltp", "adts", "audio/aac", _AAC_RATES, 64_000, whole_frames=True,
          encoder_options={"aac_coder": "fast"}),
    Codec("flac", "flac", "s16", "flac", "audio/flac", None),
    Codec("wav", "pcm_s16le", "s16", "wav", "audio/wav", None, container_options={"fflags": "+bitexact"}),
)}

OUTPUT_FORMATS = PCM_FORMATS + tuple(CODECS)


def needs_pipeline(fmt: str, speed: float) -> bool:
    """Whether a stream's output goes through an `OutputPipeline` (off the engine loop's thread)."""
    return fmt in CODECS or speed != 1.0


@dataclass(frozen=True)
class Encoded:
    """What one call of a pipeline produced."""

    data: bytes = b""
    samples: int = 0                  # what a decoder yields for these bytes, at the output rate
    packets: tuple[bytes, ...] = ()   # opus_packets: the packets (data is then their concatenation)
    durations_us: tuple[int, ...] = ()
    # The last call: (offset, bytes) to write over what earlier calls returned, now that the
    # file's length is known (`_Sink`); a streamed file cannot take them, a whole one does.
    rewrites: tuple[tuple[int, bytes], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.data)


class _Sink:
    """Where a muxer writes; what it appended is taken after every call. Seekable (FFmpeg sees
    `seek` and `tell`), so that a muxer goes back at the end to write what it learns only then:
    the FLAC muxer its STREAMINFO (without a seek it leaves total samples 0, which libsndfile
    cannot read: soundfile's `ValueError: array is too big`), the WAV muxer its sizes (else
    0xFFFFFFFF). Writes over bytes already taken are kept as rewrites. Until then the muxers
    write what they wrote into a pipe, piece for piece (measured for FLAC, WAV, MP3 and ADTS;
    Ogg up to its random stream serial), and as promptly: the same bytes after every call."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._taken = 0                   # bytes taken before the buffer's first
        self._position = 0
        self._rewrites: list[tuple[int, bytes]] = []

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._position, self._taken + len(self._buffer))[whence]
        self._position = base + offset
        return self._position

    def write(self, data: bytes) -> int:
        data = bytes(data)
        size, start = len(data), self._position
        if start < self._taken:                              # over what was taken: a rewrite
            over = data[:self._taken - start]
            self._rewrites.append((start, over))
            data, start = data[len(over):], start + len(over)
        at = start - self._taken
        self._buffer[at:at + len(data)] = data
        self._position = start + len(data)
        return size

    def take(self) -> bytes:
        data = bytes(self._buffer)
        self._taken += len(data)
        self._buffer.clear()
        return data

    def take_rewrites(self) -> tuple[tuple[int, bytes], ...]:
        rewrites, self._rewrites = tuple(self._rewrites), []
        return rewrites


class CodecEncoder:
    """One codec's encoder (and muxer) for one stream."""

    def __init__(self, codec: Codec, rate: int) -> None:
        import av

        if not codec.takes_rate(rate):
            raise ValueError(f"{codec.name} takes sample rates {list(codec.rates or ())}, not {rate}")
        self.codec = codec
        self.rate = rate
        self._sink = _Sink()
        self._container: Any = None
        if codec.container is not None:
            self._container = av.open(self._sink, mode="w", format=codec.container,
                                      options=dict(codec.container_options))
            stream = self._container.add_stream(codec.encoder, rate=rate, layout="mono")
            self._stream = stream
            context = stream.codec_context
        else:
            context = av.CodecContext.create(codec.encoder, "w")
            context.sample_rate = rate
            context.layout = "mono"
            self._stream = None
        context.format = codec.sample_format
        if codec.bit_rate:
            context.bit_rate = codec.bit_rate
        if codec.encoder_options:
            context.options = dict(codec.encoder_options)
        if self._stream is None:
            context.time_base = Fraction(1, rate)
            context.open()
        self._context = context
        self._pts = 0
        self.samples = 0                  # decoded samples produced so far

    @property
    def description(self) -> bytes | None:
        """The codec's setup bytes (Opus: the OpusHead, for WebCodecs' `description`)."""
        if self._context is None:
            return None
        extradata = self._context.extradata
        return bytes(extradata) if extradata else None

    @property
    def pre_skip(self) -> int:
        """Samples of encoder priming a decoder should drop (Opus' pre-skip, at 48 kHz)."""
        head = self.description
        if self.codec.encoder == "libopus" and head is not None and head[:8] == b"OpusHead":
            return int.from_bytes(head[10:12], "little")
        return 0

    def encode(self, pcm: np.ndarray) -> Encoded:
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if pcm.size == 0:
            return Encoded()
        fmt = self.codec.sample_format
        frame = _frame(to_int16(pcm) if fmt == "s16" else pcm, fmt, self.rate, self._pts)
        self._pts += pcm.size
        return self._emit(self._encode(frame), pcm.size)

    def finish(self) -> Encoded:
        """Drain the encoder and close the file (the last Ogg page, say)."""
        return self._emit(self._encode(None), 0, last=True)

    def close(self) -> None:
        """Free FFmpeg's encoder (and its threads) now, not whenever the garbage collector
        gets to the objects; nothing more can be encoded."""
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - closed already (after finish), or a cut-off file
                pass
        self._container = self._stream = self._context = None

    def _encode(self, frame: Any) -> list[Any]:
        if self._stream is not None:
            return list(self._stream.encode(frame))
        return list(self._context.encode(frame))

    def _emit(self, packets: list[Any], fed: int, last: bool = False) -> Encoded:
        durations = [self._packet_samples(p) for p in packets]
        if self._container is not None:
            for packet in packets:
                self._container.mux(packet)
            if last:
                self._container.close()
            samples = sum(durations) if self.codec.whole_frames else fed
            self.samples += samples
            return Encoded(self._sink.take(), samples, rewrites=self._sink.take_rewrites())
        raw = tuple(bytes(p) for p in packets)
        self.samples += sum(durations)
        return Encoded(b"".join(raw), sum(durations), raw, tuple(round(d * 1_000_000 / self.rate) for d in durations))

    def _packet_samples(self, packet: Any) -> int:
        frame_size = self._context.frame_size
        if frame_size:
            return int(frame_size)
        return int(packet.duration or 0)


class Tempo:
    """Changes speed without changing pitch (FFmpeg's atempo, WSOLA), across chunks."""

    def __init__(self, rate: int, speed: float) -> None:
        import av.filter

        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        self.rate = rate
        graph = av.filter.Graph()
        # On the caller's thread: FFmpeg's default gives each graph a pool of a thread per core,
        # which atempo (no slice threading) never uses; two idle threads a stream here.
        graph.threads = 1
        node = graph.add_abuffer(format="flt", sample_rate=rate, layout="mono", time_base=f"1/{rate}")
        for factor in _atempo_factors(speed):
            stage = graph.add("atempo", f"tempo={factor!r}")
            node.link_to(stage)
            node = stage
        sink = graph.add("abuffersink")
        node.link_to(sink)
        graph.configure()
        self._graph = graph
        self._pts = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if pcm.size == 0:
            return pcm
        self._graph.push(_frame(pcm, "flt", self.rate, self._pts))
        self._pts += pcm.size
        return self._pull()

    def flush(self) -> np.ndarray:
        self._graph.push(None)
        return self._pull()

    def close(self) -> None:
        """Free the filter graph now. PyAV (18) keeps a graph and its filters in a reference
        cycle (each filter holds its graph, the graph its filters), which only the garbage
        collector would free: the graph's own lists of its filters are emptied, so the graph
        goes with its last reference, here."""
        graph, self._graph = self._graph, None
        if graph is None:
            return
        for held in gc.get_referents(graph):
            if isinstance(held, (dict, list)):
                held.clear()

    def _pull(self) -> np.ndarray:
        import av

        out: list[np.ndarray] = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1).astype(np.float32, copy=False))
        return np.concatenate(out) if out else np.zeros(0, np.float32)


def _frame(samples: np.ndarray, fmt: str, rate: int, pts: int) -> Any:
    """One mono FFmpeg frame of `samples` (already in `fmt`), stamped at `pts` samples."""
    import av

    frame = av.AudioFrame.from_ndarray(samples[None, :], format=fmt, layout="mono")
    frame.sample_rate = rate
    frame.pts = pts
    return frame


def _atempo_factors(speed: float) -> list[float]:
    factors: list[float] = []
    while speed > 2.0:
        factors.append(2.0)
        speed /= 2.0
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    return factors + [speed]


class OutputPipeline:
    """A stream's float32 PCM (at the output rate) to wire bytes: tempo, then encoding.

    Thread-safe per instance (a lock): a stream awaits each call before the next, but a
    consumer that goes away may leave one call running when the stream is closed."""

    def __init__(self, fmt: str, rate: int, speed: float = 1.0) -> None:
        if fmt not in OUTPUT_FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.format = fmt
        self.rate = rate
        self._tempo = Tempo(rate, speed) if speed != 1.0 else None
        self._encoder = CodecEncoder(CODECS[fmt], rate) if fmt in CODECS else None
        self._lock = threading.Lock()
        self._finished = False
        self.samples = 0                      # what a decoder yields, so far

    @property
    def description(self) -> bytes | None:
        return self._encoder.description if self._encoder is not None else None

    @property
    def pre_skip(self) -> int:
        return self._encoder.pre_skip if self._encoder is not None else 0

    @property
    def seconds(self) -> float:
        return self.samples / self.rate

    def encode(self, pcm: np.ndarray) -> Encoded:
        with self._lock:
            if self._finished:
                return Encoded()
            if self._tempo is not None:
                pcm = self._tempo.process(pcm)
            return self._pack(pcm)

    def finish(self) -> Encoded:
        """The rest: what the tempo filter and the encoder still hold, and the file's end."""
        with self._lock:
            if self._finished:
                return Encoded()
            tail = self._pack(self._tempo.flush()) if self._tempo is not None else Encoded()
            self._finished = True
            if self._encoder is None:
                return tail
            last = self._encoder.finish()
            self.samples += last.samples
            return Encoded(tail.data + last.data, tail.samples + last.samples, tail.packets + last.packets,
                           tail.durations_us + last.durations_us, tail.rewrites + last.rewrites)

    def close(self) -> None:
        """The stream is over: free the encoder and the tempo filter at once (idempotent)."""
        with self._lock:
            self._finished = True
            tempo, self._tempo = self._tempo, None
            if tempo is not None:
                tempo.close()
            if self._encoder is not None:
                self._encoder.close()

    def _pack(self, pcm: np.ndarray) -> Encoded:
        if self._encoder is None:
            self.samples += pcm.size
            return Encoded(pcm_to_bytes(pcm, self.format), pcm.size) if pcm.size else Encoded()
        encoded = self._encoder.encode(pcm)
        self.samples += encoded.samples
        return encoded
