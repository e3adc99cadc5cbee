"""`vox-ws say`: a text, a file or standard input spoken by a running server into one file.

The text goes in through one stream's input (protocol v1's `chunk`s), never more at a time than
the server holds for a stream (`limits.max_text_chars`): what it has spoken, which its `segment`
events tell, makes room for more. So a document of any length is one stream, one voice and its
prosody carried from sentence to sentence, and the server's bounds apply to each piece, not to
the whole. The audio is written as it arrives (WAV patched at the end, a codec's file appended
to, and a FLAC's header rewritten at the end as the server's `end` says, its length known
then), so memory stays flat over a book. Captions (`--captions`) come from the stream's word
timings where the engine has them, else its segments.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import re
import sys
import tempfile
import time
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .. import wire
from ..audio import bytes_to_pcm, pcm_to_bytes
from .captions import CAPTION_FORMATS, cues_from_segments, cues_from_words, write_captions
from .v1 import ProtocolViolation, Stream, VoxError, connect

# `say --play`: seconds of audio the server may send ahead of what the speakers have played.
PLAY_LOOKAHEAD_S = 3.0
# Bytes read from a file or standard input at a time; the most characters one `chunk` carries.
READ_BYTES = 16_384
MAX_PIECE_CHARS = 1_000
_WHITESPACE = re.compile(r"\s+")


@dataclass
class Progress:
    """How far a document has got: characters (not counting whitespace) sent and spoken."""

    total: int | None                        # None: standard input, whose end is not known
    sent: int = 0
    spoken: int = 0
    audio_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    # Set when more has been spoken: the feeder waits on it for room.
    moved: asyncio.Event = field(default_factory=asyncio.Event)

    def spoke(self, text: str, end_s: float) -> None:
        self.spoken += spoken_chars(text)
        self.audio_s = end_s
        self.moved.set()

    async def room(self, window: int) -> None:
        """Until fewer than `window` characters sent wait to be spoken."""
        while self.sent - self.spoken > window:
            self.moved.clear()
            await self.moved.wait()

    def line(self) -> str:
        of = f" of {self.total}" if self.total is not None else ""
        return f"{self.spoken}{of} characters spoken, {self.audio_s:.1f} s of audio"


def spoken_chars(text: str) -> int:
    """What counts towards progress: a text's characters less its whitespace (the server reports
    segments with their whitespace tidied)."""
    return sum(1 for c in text if not c.isspace())


async def read_blocks(path: str | None, text: str | None) -> AsyncIterator[str]:
    """The text as it comes: the argument, or a file read a block at a time (`-`: standard input,
    so `an-llm | vox-ws say -` speaks as it writes)."""
    if text is not None:
        yield text
        return
    fd = sys.stdin.fileno() if path == "-" else os.open(path, os.O_RDONLY)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        while True:
            data = await asyncio.to_thread(os.read, fd, READ_BYTES)
            block = decoder.decode(data, final=not data)
            if block:
                yield block
            if not data:
                return
    finally:
        if path != "-":
            os.close(fd)


async def pieces(blocks: AsyncIterator[str], limit: int) -> AsyncIterator[str]:
    """Blocks of text as pieces of at most `limit` characters, cut after a whitespace where there
    is one, each run of whitespace one character (a newline if it held one): so what the server
    counts of a piece is at most twice what progress counts of it. Nothing is held back for the
    next block: text read is text sent."""
    after_space = True
    async for block in blocks:
        text = _WHITESPACE.sub(lambda run: "\n" if "\n" in run.group() else " ", block)
        if after_space:
            text = text.lstrip()
        if not text:
            continue
        after_space = text[-1].isspace()
        while len(text) > limit:
            cut = max(text.rfind(" ", 0, limit), text.rfind("\n", 0, limit)) + 1
            cut = cut or limit                  # a word longer than a piece: cut at the limit
            yield text[:cut]
            text = text[cut:]
        if text:
            yield text


class AudioFile:
    """The output file, written as the audio arrives: WAV (16-bit; its header patched when it is
    closed, also after an interruption), raw PCM (`s16`, `mulaw`), or a codec's bytes as the
    server encodes them (a FLAC's header rewritten once the server sends it with its length)."""

    def __init__(self, path: str, fmt: str, rate: int) -> None:
        self.path = path
        self.format = fmt
        self.rate = rate
        self.bytes = 0
        if fmt == "wav":
            self._wav = wave.open(path, "wb")
            self._wav.setnchannels(1)
            self._wav.setsampwidth(2)
            self._wav.setframerate(rate)
        else:
            self._file = open(path, "wb")

    def write(self, data: bytes) -> None:
        self.bytes += len(data)
        if self.format == "wav":
            self._wav.writeframes(data)
        else:
            self._file.write(data)

    def rewrite(self, rewrites: Any) -> None:
        """What the server's `end` says to write over the file's start now that its length is
        known (FLAC's STREAMINFO): `[[offset, bytes], ...]` within what was written. Raises
        ValueError for anything else (the file is left as it was)."""
        if self.format == "wav" or not rewrites:
            return
        if not isinstance(rewrites, list) or not all(
                isinstance(item, list) and len(item) == 2 and type(item[0]) is int
                and isinstance(item[1], bytes) and 0 <= item[0] <= item[0] + len(item[1]) <= self.bytes
                for item in rewrites):
            raise ValueError(f"the server's end has rewrites {rewrites!r:.60} that are not within the file's "
                             f"{self.bytes} bytes")
        for offset, data in rewrites:
            self._file.seek(offset)
            self._file.write(data)
        self._file.seek(0, os.SEEK_END)

    def close(self) -> None:
        (self._wav if self.format == "wav" else self._file).close()

    @property
    def seconds(self) -> float | None:
        """The audio the file holds, where its bytes tell (WAV, raw PCM); None for an encoded file."""
        width = {"wav": 2, "s16": 2, "mulaw": 1}.get(self.format)
        return self.bytes / width / self.rate if width else None


def _bar(progress: Progress, quiet: bool) -> Any:
    """A progress bar on standard error (characters spoken of the total, audio seconds, the
    real-time factor, time left), where that is a terminal; else none."""
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=progress.total, unit="char", file=sys.stderr, dynamic_ncols=True,
                desc="speaking")


async def say(args: Any) -> int:
    """The `say` command (see cli.py for its arguments). 0: all spoken; 1: the server refused or
    failed (what was spoken is kept); 130: interrupted (likewise)."""
    text = args.text
    if args.file is not None and args.file != "-" and not os.path.isfile(args.file):
        print(f"vox-ws say: no such file: {args.file}", file=sys.stderr)
        return 2
    progress = Progress(total=spoken_chars(text) if text is not None else _file_chars(args.file))
    player = None
    if args.play:
        player = _player()
        if player is None:
            print("vox-ws say --play: no audio output found (install `sounddevice`, or aplay/paplay/ffplay)",
                  file=sys.stderr)
            return 2
    out: AudioFile | None = None
    words: list[tuple[str, float, float]] = []
    segments: list[tuple[str, float, float]] = []
    bar = _bar(progress, args.quiet)
    outcome = 0
    believed = True                # False once the server sent what protocol v1 forbids
    try:
        # Every number the server sends is checked by the client (v1.py: a time that is no
        # finite number of seconds at or after 0, or out of order, a sample rate outside the
        # protocol's), and a server that says nothing for `--timeout` seconds is given up.
        async with connect(args.url, token=args.token, silence_timeout_s=args.timeout) as client:
            features = client.hello.features
            limits = client.hello.limits
            limit = limits.get("max_text_chars") if isinstance(limits, dict) else None
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise ProtocolViolation(f"the server's hello has limits.max_text_chars {limit!r:.40}, "
                                        "not a count of characters")
            if not isinstance(features, list):
                raise ProtocolViolation(f"the server's hello has features {features!r:.40}, not a list")
            timed_words = args.captions is not None and "word_timestamps" in features
            wire_format = "f32" if player is not None else ("s16" if args.format == "wav" else args.format)
            stream = await client.open_stream(
                voice=args.voice, format=wire_format, sample_rate=args.sample_rate, segment_events=True,
                speed=args.speed, instructions=args.instructions, word_timestamps=timed_words, language=args.language,
                lookahead_s=PLAY_LOOKAHEAD_S if player is not None else None)
            rate = stream.sample_rate          # 8,000-48,000 Hz (v1.py checks it)
            if args.output:
                out = AudioFile(args.output, args.format, rate)
            if player is not None:
                player.open(rate)
            # Progress counts no whitespace, the server does, and `pieces` leaves at most one
            # whitespace per character: a third of the bound unspoken (two thirds as the server
            # counts) and a piece of a third never make more than the server holds.
            window = max(1, min(MAX_PIECE_CHARS, limit // 3))
            feeder = asyncio.create_task(_feed(stream, pieces(read_blocks(args.file, text), window), progress,
                                               window))
            try:
                async for message in stream.events():
                    if isinstance(message, wire.AudioChunk):
                        data = message.audio
                        if player is not None:               # --play writes WAV only (check_args)
                            data = pcm_to_bytes(bytes_to_pcm(data, "f32"), "s16")
                            player.write(data)
                        if out is not None and data:
                            out.write(data)
                    elif isinstance(message, wire.Segment):
                        segments.append((message.text, message.start_s, message.end_s))
                        progress.spoke(message.text, message.end_s)
                        _advance(bar, progress)
                    elif isinstance(message, wire.Words):
                        words += [(w["word"], w["start_s"], w["end_s"]) for w in message.words]
                        if words:
                            progress.audio_s = max(progress.audio_s, words[-1][2])
                    elif isinstance(message, wire.Ended):
                        if message.audio_s is not None:
                            progress.audio_s = message.audio_s
                        if out is not None:
                            out.rewrite(message.rewrites)
                await feeder
            finally:
                feeder.cancel()
    except VoxError as err:
        print(f"vox-ws say: {err.code}: {err.message}", file=sys.stderr)
        believed = not isinstance(err, ProtocolViolation)
        outcome = 1
    except ValueError as err:                 # what the server said cannot be written
        print(f"vox-ws say: {err}", file=sys.stderr)
        outcome = 1
    except OSError as err:
        print(f"vox-ws say: cannot reach {args.url}: {err}", file=sys.stderr)
        outcome = 1
    except PlayerFailed as err:
        print(f"vox-ws say --play: {err}", file=sys.stderr)
        outcome = 1
    except asyncio.CancelledError:
        outcome = 130
    finally:
        if bar is not None:
            bar.close()
        if out is not None:
            out.close()
        if player is not None:
            try:
                player.close()
            except PlayerFailed as err:
                print(f"vox-ws say --play: {err}", file=sys.stderr)
                outcome = outcome or 1
        # Times from a server that broke the protocol are not written as captions, not even
        # those before its bad one.
        if not believed:
            args.captions = None
        if args.captions and (words or segments):
            write_captions(cues_from_words(words) if words else cues_from_segments(segments), args.captions)
        _report(args, progress, out, outcome)
    return outcome


async def _feed(stream: Stream, pieces: AsyncIterator[str], progress: Progress, window: int) -> None:
    """Send the text as the server makes room for it, then end the input."""
    async for piece in pieces:
        await progress.room(window)
        await stream.send_text(piece)
        progress.sent += spoken_chars(piece)
        if piece and not any(c.isspace() for c in piece):
            # A word longer than a piece: the server cuts a word only when told to, so it would
            # wait for its end as long as it holds room for it. Spoken as it is now.
            await stream.flush(wait=False)
    await stream.end()


def _advance(bar: Any, progress: Progress) -> None:
    if bar is None:
        return
    bar.n = progress.spoken
    elapsed = time.monotonic() - progress.started
    bar.set_postfix_str(f"{progress.audio_s:.0f} s audio, RTF {elapsed / progress.audio_s:.2f}"
                        if progress.audio_s else "")


def _report(args: Any, progress: Progress, out: AudioFile | None, outcome: int) -> None:
    # What the file holds: a WAV's own length; else as far as the words and sentences reached.
    held = out.seconds if out is not None and out.seconds is not None else progress.audio_s
    # The rate too: a raw PCM file (s16, mulaw) says it nowhere else.
    where = f"; {out.path} holds {held:.1f} s ({out.bytes} bytes of {out.format} at {out.rate} Hz)" if out else ""
    captions = f"; captions in {args.captions}" if args.captions and progress.spoken else ""
    if outcome == 0:
        print(f"vox-ws say: {progress.line()}{where}{captions}", file=sys.stderr)
    elif outcome == 130:
        print(f"vox-ws say: interrupted after {progress.line()}{where}{captions}", file=sys.stderr)
    else:
        print(f"vox-ws say: stopped after {progress.line()}{where}{captions}", file=sys.stderr)


def _file_chars(path: str | None) -> int | None:
    """The characters of a file to be spoken (for the progress bar); None for standard input."""
    if path is None or path == "-":
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return sum(spoken_chars(block) for block in iter(lambda: f.read(1 << 16), ""))


# The file formats `say` writes, by the output's extension (`s16`: 16-bit little-endian mono, and
# `mulaw`: G.711 µ-law, raw, at the stream's rate).
FORMAT_OF_EXTENSION = {".wav": "wav", ".mp3": "mp3", ".opus": "opus", ".ogg": "opus", ".oga": "opus", ".aac": "aac",
                       ".flac": "flac", ".pcm": "s16", ".raw": "s16", ".ulaw": "mulaw", ".ul": "mulaw",
                       ".mulaw": "mulaw"}


def check_args(args: Any) -> str | None:
    """What is wrong with `say`'s arguments, if anything; settles `args.format` (the output's
    extension's, where --format does not say it)."""
    if (args.text is None) == (args.file is None):
        return "give a text, or --file PATH (- for standard input), not both"
    extension = os.path.splitext(args.output or "")[1].lower()
    named = FORMAT_OF_EXTENSION.get(extension)
    if args.format is not None and named is not None and named != args.format:
        return f"--format {args.format} contradicts {args.output}, a {named} file's name: drop one"
    if extension and named is None and args.format is None:
        # Written as WAV, a .m4a or .webm file's name lied about what it held.
        return (f"cannot write a {extension} file: name it {', '.join(sorted(FORMAT_OF_EXTENSION))}, "
                "or give --format")
    args.format = args.format or named or "wav"
    if args.play and args.format not in ("wav", "s16"):
        return "--play plays PCM; write other formats with -o FILE"
    if not args.output and not args.play:
        return "give -o FILE and/or --play"
    if args.captions and not args.captions.lower().endswith(CAPTION_FORMATS):
        return "--captions writes a .srt or .vtt file"
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not 0 < timeout < float("inf"):
        return "--timeout is seconds, more than 0"
    return None


class PlayerFailed(Exception):
    """The audio output could not play (no sound card, the player stopped)."""


class _Player:
    """Plays 16-bit mono PCM as it arrives, through the first audio output found. Raises
    PlayerFailed when it cannot: a player program that stops, or ends with an error."""

    def __init__(self, command: list[str] | None) -> None:
        self.command = command
        self.proc = None
        self.stream = None

    def open(self, rate: int) -> None:
        import subprocess

        if self.command is None:
            import sounddevice

            self.stream = sounddevice.RawOutputStream(samplerate=rate, channels=1, dtype="int16")
            self.stream.start()
        else:
            argv = [part.replace("{rate}", str(rate)) for part in self.command]
            # What it says goes to a file, read when it fails: a pipe nobody reads could fill.
            self._said = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=self._said)

    def write(self, data: bytes) -> None:
        if self.stream is not None:
            self.stream.write(data)
            return
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise PlayerFailed(self._failure()) from None

    def close(self) -> None:
        if self.stream is not None:
            self.stream.stop()
            self.stream.close()
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            if self.proc.wait() != 0:
                raise PlayerFailed(self._failure())

    def _failure(self) -> str:
        code = self.proc.wait()
        self._said.seek(0)
        said = [line.strip() for line in self._said.read().decode(errors="replace").splitlines() if line.strip()]
        return f"{self.command[0]} could not play (exit {code}){': ' + said[-1] if said else ''}"


def _player() -> _Player | None:
    import shutil

    try:
        import sounddevice

        sounddevice.query_devices(kind="output")
        return _Player(None)
    except Exception:  # noqa: BLE001 - not installed, or no device: try the command-line players
        pass
    for tool, argv in (("paplay", ["paplay", "--raw", "--rate={rate}", "--channels=1", "--format=s16le"]),
                       ("aplay", ["aplay", "-q", "-f", "S16_LE", "-c", "1", "-r", "{rate}"]),
                       ("ffplay", ["ffplay", "-loglevel", "quiet", "-autoexit", "-nodisp", "-f", "s16le",
                                   "-ar", "{rate}", "-ac", "1", "-"])):
        if shutil.which(tool):
            return _Player(argv)
    return None
