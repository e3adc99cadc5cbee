"""The Wyoming front door (Home Assistant's protocol for voice services), on the same stream
service as every other door.

    describe                                   -> info (voices, supports_synthesize_streaming), once loaded
    synthesize {text, voice}                   -> audio-start, audio-chunk..., audio-stop
    synthesize-start {voice}
      synthesize-chunk {text} ...              -> per sentence: audio-start, audio-chunk..., audio-stop
      synthesize-stop                          -> ... then synthesize-stopped
    ping                                       -> pong

Events are framed by the `wyoming` package (a JSON header line, optional JSON data, an optional
binary payload). Wyoming carries no request ids, so one connection speaks one request at a time,
in the order asked; Home Assistant's `synthesize` sent inside a streaming request (for older
servers) is ignored there, as Wyoming's own servers do. Anything refused (a bad event, a frame
that cannot be read, a stream that fails) is answered with an `error` event, and the connection
is then closed, as wyoming-piper does: Home Assistant reads no `error` event and would otherwise
wait on the open connection until its own time-out.

The v1 limits hold: connections per address and in all, a message budget per connection
(`max_messages_per_s`), and a connection with no request being spoken that sends nothing for
`idle_timeout_s` is closed, whatever it sent before. Wyoming has no authentication: serve it on
a trusted network only. Behind a TCP balancer in `--trusted-proxies` that sends a PROXY header
(v1 or v2), the address it names is the client's for those limits and for voice ownership.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import Counter
from typing import Any

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice, TtsVoiceSpeaker
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler, AsyncServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from .. import __version__
from ..addresses import DEFAULT_IPV6_PREFIX, client_key
from ..engine import ErrorKind, Readiness, Refused
from ..service import AudioOutput, StreamRequest, StreamService
from ..service.events import Audio, Ended, Failed, Segment
from ..service.stream import Stream
from ..service.voices.aliases import Alias
from ..service.voices.names import with_speaker
from .auth import address_owner
from .protocol import code_for, model_id
from .proxies import ProxyHeaderError, TrustedProxies, parse_proxy_header, v2_header_length
from .rate import MessageBudget

log = logging.getLogger("vox_ws.wyoming")

# Wyoming audio is signed 16-bit PCM, mono, at the engine's own rate.
SAMPLE_WIDTH = 2
CHANNELS = 1
# What `describe` lists for an engine without built-in voices: its default voice.
DEFAULT_VOICE = "default"
# An alias's instructions shown in `describe` (its description, in Home Assistant's picker), at most.
MAX_INSTRUCTIONS_SHOWN = 60
# The JSON header line, the JSON data and the payload of one client event, at most. Clients
# send text only; the package's own reader would trust any declared length.
MAX_HEADER_BYTES = 64 << 10


# Whom Home Assistant credits for a voice: the engine that speaks it.
PROJECT_URL = "https://pypi.org/project/vox-ws/"
ENGINE_ATTRIBUTIONS = {"piper": ("Piper (Open Home Foundation)", "https://github.com/OHF-Voice/piper1-gpl"),
                       "voxcpm": ("VoxCPM2 (OpenBMB)", "https://github.com/OpenBMB/VoxCPM")}


class WyomingServer:
    """Listens on a Wyoming URI (tcp://HOST:PORT or unix://PATH) beside the WebSocket port."""

    def __init__(self, uri: str, service: StreamService, proxies: TrustedProxies | None = None,
                 ipv6_prefix: int = DEFAULT_IPV6_PREFIX) -> None:
        self.uri = uri
        self.service = service
        self.proxies = proxies or TrustedProxies()
        self.ipv6_prefix = ipv6_prefix          # an IPv6 client counts by its network (`addresses`)
        # How long `describe` waits for the engine's load (None: as long as a connection may say
        # nothing, the service's idle time-out).
        self.describe_wait_s: float | None = None
        self._server = AsyncServer.from_uri(uri)
        self._numbers = itertools.count(1)
        self.connections = 0
        self.per_address: Counter[str] = Counter()

    async def start(self) -> None:
        await self._server.start(self._handler)
        log.info("Wyoming on %s", self.uri)

    @property
    def port(self) -> int | None:
        """The TCP port listened on (useful with tcp://HOST:0)."""
        server = getattr(self._server, "_server", None)
        if server is None or not server.sockets:
            return None
        return server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self._server.stop()

    def _handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> "WyomingHandler":
        return WyomingHandler(self, next(self._numbers), reader, writer)


class WyomingHandler(AsyncEventHandler):
    """One Wyoming connection."""

    def __init__(self, server: WyomingServer, number: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.server = server
        self.service = server.service
        peer = writer.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else "local"
        self.number = number
        self._first_line: bytes | None = None       # read while looking for a PROXY header
        self._stream: Stream | None = None
        self._speaking: asyncio.Task | None = None   # writes the current request's audio
        self._streaming = False                      # between synthesize-start and synthesize-stop
        self._request_ended_at = 0.0                 # loop time the last request's audio was written
        self._failed = False                         # an error was sent: the connection closes
        self.budget = MessageBudget(self.service.limits.max_messages_per_s)

    async def run(self) -> None:
        limits = self.service.limits
        server = self.server
        if server.proxies.trusts(self.peer):
            try:
                await asyncio.wait_for(self._read_proxy_header(), limits.body_timeout_s)
            except (ProxyHeaderError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                    ValueError) as exc:
                log.warning("wyoming-%d (%s): no valid PROXY header (%s): closing", self.number, self.peer,
                            exc or type(exc).__name__)
                self.writer.close()
                return
        server.connections += 1
        counted = client_key(self.peer, server.ipv6_prefix)
        server.per_address[counted] += 1
        try:
            if server.connections > limits.max_connections:
                await self._error(ErrorKind.BUSY, f"over max_connections={limits.max_connections}")
                return
            if (server.per_address[counted] > limits.max_connections_per_address
                    and not server.proxies.trusts(self.peer)):
                await self._error(ErrorKind.BUSY, "too many connections from your address (over "
                                                  f"max_connections_per_address={limits.max_connections_per_address})")
                return
            while not self._failed:
                event = await self._read_event()
                if event is None or self._failed:
                    return
                if not self.budget.take():
                    if self.budget.exhausted:
                        await self._error(ErrorKind.BUSY, "message rate limit exceeded: closing the connection")
                        return
                    await self._error(ErrorKind.BUSY, f"over max_messages_per_s={limits.max_messages_per_s:g}: "
                                                      f"{event.type!r} not served")
                    continue
                await self.handle_event(event)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            return
        finally:
            server.connections -= 1
            server.per_address[counted] -= 1
            if server.per_address[counted] <= 0:
                del server.per_address[counted]
            await self.disconnect()
            self.writer.close()

    async def _read_proxy_header(self) -> None:
        """From a trusted balancer: the client its PROXY header names becomes this connection's
        peer. A connection that starts with a Wyoming event instead is the balancer's own."""
        line = await self.reader.readline()
        if line.startswith(b"PROXY "):
            header = parse_proxy_header(line)
        elif line == b"\r\n":                   # v2's signature begins with a blank line
            fixed = line + await self.reader.readexactly(14)
            header = parse_proxy_header(fixed + await self.reader.readexactly(v2_header_length(fixed) - len(fixed)))
        else:
            self._first_line = line
            return
        if header is None or not header.length:
            raise ProxyHeaderError("a connection that began like a PROXY header and was not one")
        if header.source is not None:
            self.peer = header.source

    async def disconnect(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._speaking is not None:
            self._speaking.cancel()
            await asyncio.gather(self._speaking, return_exceptions=True)

    async def write_event(self, event: Event) -> None:
        """Writes one event; a client that reads nothing for `write_stall_timeout_s` while the
        socket's buffers are full loses the connection (its stream is cancelled with it)."""
        try:
            await asyncio.wait_for(super().write_event(event), self.service.limits.write_stall_timeout_s)
        except asyncio.TimeoutError:
            log.warning("wyoming-%d (%s): read nothing for %gs: aborting the connection", self.number, self.peer,
                        self.service.limits.write_stall_timeout_s)
            self.writer.transport.abort()
            raise ConnectionError("the client stopped reading") from None

    def _busy(self) -> bool:
        """A request's audio is being spoken (an open streaming request whose stream failed or
        timed out is not: the connection is idle again)."""
        return self._speaking is not None and not self._speaking.done()

    async def _next_line(self) -> bytes:
        """The next header line. A connection with no request in progress that sends nothing
        for `idle_timeout_s` is told so (`error {code: "timeout"}`) and closed, as v1 reaps idle
        sessions. (Waiting on readline again after a time-out loses nothing: it takes bytes
        only once a whole line is there.)"""
        if self._first_line is not None:
            line, self._first_line = self._first_line, None
            return line
        idle_s = self.service.limits.idle_timeout_s
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while True:
            try:
                return await asyncio.wait_for(self.reader.readline(), max(0.0, quiet_since + idle_s - loop.time()))
            except asyncio.TimeoutError:
                now = loop.time()
                if self._busy():
                    quiet_since = now
                elif self._request_ended_at > quiet_since:
                    quiet_since = self._request_ended_at
                else:
                    await self._error(ErrorKind.TIMEOUT, f"idle for {idle_s:g}s: closing the connection")
                    raise

    async def handle_event(self, event: Event) -> bool:
        try:
            await self._handle(event)
        except Refused as err:
            await self._error(err.kind, _worded(err.kind, err.message, err.field))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            await self._error(ErrorKind.INVALID, f"bad {event.type!r} event: {type(exc).__name__}: {exc}")
        return True

    async def _handle(self, event: Event) -> None:
        kind = event.type
        if Describe.is_type(kind):
            # Once the engine has loaded: what `info` lists is what the server serves. Home
            # Assistant keeps the first answer for the life of its config entry: the placeholder
            # this gave during the load (`default`, one language) stood after every reboot until
            # the integration was reloaded by hand.
            await self._until_loaded()
            await self.write_event((await self._info()).event())
        elif Ping.is_type(kind):
            await self.write_event(Pong(text=Ping.from_event(event).text).event())
        elif Synthesize.is_type(kind):
            if self._streaming:
                return          # the whole text again, for servers that cannot stream: already heard
            request = Synthesize.from_event(event)
            await self._until_loaded()
            await self._wait_for_previous()
            stream = self._open(_text(request.text), request.voice, streaming=False, text_format=request.text_format)
            self._speak(stream, streaming=False)
        elif SynthesizeStart.is_type(kind):
            if self._streaming:
                raise Refused(ErrorKind.INVALID, "a streaming synthesis is already open (send synthesize-stop)")
            request = SynthesizeStart.from_event(event)
            await self._until_loaded()
            await self._wait_for_previous()
            stream = self._open(None, request.voice, streaming=True, text_format=request.text_format)
            self._streaming = True
            self._speak(stream, streaming=True)
        elif SynthesizeChunk.is_type(kind):
            text = _text(SynthesizeChunk.from_event(event).text)
            stream = self._open_stream()
            if not stream.done:
                stream.send_text(text)
        elif SynthesizeStop.is_type(kind):
            stream = self._open_stream()
            self._streaming = False
            if stream.done:
                # It failed (the error event was sent): the request is over all the same.
                await self.write_event(SynthesizeStopped().event())
            else:
                stream.end_input()
        else:
            raise Refused(ErrorKind.UNSUPPORTED, f"event {kind!r} is not served here (a text-to-speech service)")

    def _open_stream(self) -> Stream:
        if not self._streaming or self._stream is None:
            raise Refused(ErrorKind.INVALID, "no streaming synthesis is open (send synthesize-start first)")
        return self._stream

    def _open(self, text: str | None, voice: Any, streaming: bool, text_format: Any = None) -> Stream:
        """A stream for a request; `text_format` (wyoming >= 1.9) "ssml" reads the text as SSML
        (a `<speak>` root added where it lacks one), "text" as plain text even where it starts
        with `<speak`; unsaid, a text starting with `<speak` is SSML."""
        name = voice.name if voice is not None and voice.name else None
        language = voice.language if voice is not None and voice.language else None
        speaker = voice.speaker if voice is not None and voice.speaker else None
        engine = self.service.engine
        if name == DEFAULT_VOICE and not engine.voices.has(name):
            name = None                       # the entry `describe` lists for an engine without voices
        elif name is not None and not engine.voices.has(name) and name in engine.languages:
            # Home Assistant may name a voice by its language alone ("en_US").
            language, name = language or name, self._voice_for_language(name)
        elif name is None and language is not None:
            name = self._voice_for_language(language)
        name = with_speaker(name, speaker)
        markup = {"ssml": "ssml", "text": "none"}.get(getattr(text_format, "value", text_format))
        request = StreamRequest(text, voice=name, output=AudioOutput("s16"), input_streaming=streaming,
                                language=language, markup=markup)
        owner = address_owner(self.peer, self.server.ipv6_prefix)
        stream = self.service.open_stream(request, owners=(owner, f"wyoming-{self.number}"),
                                          log_fields={"transport": "wyoming", "peer": self.peer})
        self._stream = stream
        return stream

    def _voice_for_language(self, language: str) -> str | None:
        """The first voice that speaks `language` (None: the default voice)."""
        engine = self.service.engine
        return next((v for v in self.service.voices.listed()
                     if ":" not in v and language in engine.voices.languages(v)), None)

    async def _wait_for_previous(self) -> None:
        if self._speaking is not None and not self._speaking.done():
            await asyncio.shield(self._speaking)

    def _speak(self, stream: Stream, streaming: bool) -> None:
        self._speaking = asyncio.create_task(self._write_audio(stream, streaming),
                                             name=f"vox-ws-wyoming-{self.number}")

    async def _write_audio(self, stream: Stream, streaming: bool) -> None:
        """One request's events to Wyoming audio: one utterance for `synthesize`; one per
        sentence (segment) as it is spoken for a streaming request, then synthesize-stopped."""
        rate = stream.sample_rate
        audio_format = {"rate": rate, "width": SAMPLE_WIDTH, "channels": CHANNELS}
        in_utterance = False
        utterance_samples = 0
        try:
            async for event in stream:
                if isinstance(event, Audio):
                    if not in_utterance:
                        await self.write_event(AudioStart(**audio_format).event())
                        in_utterance, utterance_samples = True, 0
                    await self.write_event(AudioChunk(audio=event.data, timestamp=utterance_samples * 1000 // rate,
                                                      **audio_format).event())
                    utterance_samples += event.samples
                elif isinstance(event, Segment) and streaming and in_utterance:
                    await self.write_event(AudioStop().event())
                    in_utterance = False
                elif isinstance(event, Ended):
                    if in_utterance or not streaming:
                        if not in_utterance:       # nothing was spoken: still one (empty) utterance
                            await self.write_event(AudioStart(**audio_format).event())
                        await self.write_event(AudioStop().event())
                    if streaming:
                        await self.write_event(SynthesizeStopped().event())
                elif isinstance(event, Failed):
                    await self._error(event.kind, _worded(event.kind, event.message, event.field))
        except (ConnectionError, RuntimeError):
            stream.close()       # the client left while being written to
        finally:
            self._request_ended_at = asyncio.get_running_loop().time()

    async def _until_loaded(self) -> None:
        """Until the engine has loaded, for `describe` and a synthesis sent during the load. A
        load still going after `describe_wait_s` (the longest a connection may wait with nothing
        said, `idle_timeout_s`), or one that failed, is `error {code: not_ready}` and the
        connection closes: a client asks again (Home Assistant waits 1 s for an answer, tries 4
        times 2 s apart, then retries the entry's setup later)."""
        wait_s = self.server.describe_wait_s
        status = await self.service.until_loaded(self.service.limits.idle_timeout_s if wait_s is None else wait_s)
        if status != Readiness.READY:
            raise self.service.devices.not_ready()

    async def _info(self) -> Info:
        """Every voice Home Assistant's picker should offer, read afresh at each `describe`: the
        built-in ones, the aliases the aliases file names (OpenAI's default names are for
        OpenAI's clients: listed, they crowded the picker with names for voices it listed
        already; they are still spoken when named), and the voices this address registered by
        name, then the public voices of other owners (by name: a Wyoming client has no token,
        and registers nothing; its own voice of a name comes first). The picker shows a voice's
        description, not its name: each description leads with what a user would call the
        voice, and no two read alike."""
        engine = self.service.engine
        voices_service = self.service.voices
        attribution = Attribution(*ENGINE_ATTRIBUTIONS.get(engine.name, (f"vox-ws ({engine.name})", PROJECT_URL)))

        def voice(name: str, description: str, speaks: str | None) -> TtsVoice:
            speakers = engine.voices.speakers(name)
            return TtsVoice(name=name, description=description, attribution=attribution, installed=True,
                            version=__version__, languages=list(engine.voices.languages(speaks)),
                            speakers=[TtsVoiceSpeaker(name=s) for s in speakers] if speakers else None)

        # A voice of several speakers is listed once, its speakers with it (`voice.speaker`).
        voices = [voice(name, engine.voices.description(name), name)
                  for name in voices_service.listed() if ":" not in name] or \
            [voice(DEFAULT_VOICE, DEFAULT_VOICE, None)]
        for name, alias in voices_service.aliases(in_file_only=True).items():
            voices.append(voice(name, f"{name} ({_alias_described(alias)})", alias.voice))
        owner = address_owner(self.peer, self.server.ipv6_prefix)
        try:
            every_owned = await voices_service.owned_by(owner)
            owned = [v for v in every_owned if v.name]
            public = await voices_service.sharing.others_for(owner, every_owned)
        except Refused:                                 # the store cannot be reached: the others stand
            owned, public = [], []
        voices += [voice(v.name, f"{v.name} (registered)", None) for v in owned]
        voices += [voice(v.name, f"{v.name} (public)", None) for v in public]
        described = f"vox-ws streaming text-to-speech ({model_id(engine.model)})"
        program = TtsProgram(name="vox-ws", description=described,
                             attribution=attribution, installed=True, version=__version__, voices=voices,
                             supports_synthesize_streaming=True)
        return Info(tts=[program])

    async def _error(self, kind: ErrorKind, message: str) -> None:
        """Sends `error` (the codes of protocol v1's, docs/PROTOCOL.md), then closes the
        connection, as wyoming-piper does: Home Assistant reads no `error` event, and waits on
        a connection left open until its own time-out."""
        self._failed = True
        try:
            await self.write_event(Error(text=message, code=code_for(kind)).event())
        finally:
            self.writer.close()

    async def _read_event(self) -> Event | None:
        """The next event, or None at the end of the connection (or after an error, which
        closes it)."""
        try:
            line = await self._next_line()
        except ValueError:                        # a header line over the reader's limit
            await self._error(ErrorKind.TOO_LARGE, f"event header over {MAX_HEADER_BYTES} bytes")
            return None
        if not line:
            return None
        try:
            header = json.loads(line)
            kind = header["type"]
            data = header.get("data") or {}
            data_length = int(header.get("data_length") or 0)
            payload_length = int(header.get("payload_length") or 0)
            if not isinstance(kind, str) or not isinstance(data, dict):
                raise TypeError("'type' must be a string and 'data' an object")
        except RecursionError:
            await self._error(ErrorKind.INVALID, "not a Wyoming event header: JSON nested too deeply")
            return None
        except (ValueError, KeyError, TypeError) as exc:
            await self._error(ErrorKind.INVALID, f"not a Wyoming event header: {type(exc).__name__}: {exc}")
            return None
        if not 0 <= data_length <= MAX_HEADER_BYTES or not 0 <= payload_length <= MAX_HEADER_BYTES:
            await self._error(ErrorKind.TOO_LARGE, f"event data or payload over {MAX_HEADER_BYTES} bytes")
            return None
        try:
            raw_data, payload = await asyncio.wait_for(self._read_rest(data_length, payload_length),
                                                       self.service.limits.body_timeout_s)
        except asyncio.TimeoutError:
            await self._error(ErrorKind.TIMEOUT, f"the event's data and payload did not follow its header within "
                                                 f"{self.service.limits.body_timeout_s:g}s: closing the connection")
            return None
        if raw_data is not None:
            try:
                more = json.loads(raw_data)
                if not isinstance(more, dict):
                    raise TypeError("the event data must be an object")
            except RecursionError:
                await self._error(ErrorKind.INVALID, "bad event data: JSON nested too deeply")
                return None
            except (ValueError, TypeError) as exc:
                await self._error(ErrorKind.INVALID, f"bad event data: {exc}")
                return None
            data.update(more)
        return Event(type=kind, data=data, payload=payload)

    async def _read_rest(self, data_length: int, payload_length: int) -> tuple[bytes | None, bytes | None]:
        """An event's data and payload, after its header line."""
        raw_data = await self.reader.readexactly(data_length) if data_length else None
        payload = await self.reader.readexactly(payload_length) if payload_length else None
        return raw_data, payload


def _alias_described(alias: Alias) -> str:
    """What an alias stands for, in a few words: its voice (or its instructions, cut short),
    and its speed."""
    if alias.voice:
        what = f"alias of {alias.voice}"
    elif alias.instructions:
        shown = alias.instructions if len(alias.instructions) <= MAX_INSTRUCTIONS_SHOWN else \
            alias.instructions[:MAX_INSTRUCTIONS_SHOWN - 1].rstrip() + "…"
        what = f"designed: {shown}"
    else:
        what = "alias of the default voice"
    return what + (f", at {alias.speed:g}x" if alias.speed != 1.0 else "")


def _worded(kind: ErrorKind, message: str, field: str | None) -> str:
    """A refusal in this door's words: an unknown voice is one of the voices `describe` lists
    (a Wyoming client registers none: the service's words name registered voices too)."""
    if kind is ErrorKind.INVALID and field == "voice" and message.startswith("unknown voice "):
        return message.partition(" (")[0] + ": name one of the voices `describe` lists"
    return message


def _text(text: Any) -> str:
    if not isinstance(text, str):
        raise Refused(ErrorKind.INVALID, "field 'text' must be a string")
    return text
