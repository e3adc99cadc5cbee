"""OpenAI's speech API on the server's port, for the tools that already speak it.

    POST /v1/audio/speech     text in a JSON body; the audio streams back as it is generated
                              (chunked), or as server-sent events (`stream_format: "sse"`)
    GET  /v1/models           the served model, as OpenAI clients list models
    GET  /v1/models/{id}

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the status
OpenAI would give. The body's extensions (`sample_rate` and the engine's options, flat in the
body) are documented in docs/PROTOCOL.md. The response starts only once the first audio is
ready, so that a refusal found on the way (the queue wait ran out, the text does not fit) still
gets its status; a client that goes away cancels its stream at once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from ..codecs import CODECS
from ..engine import ErrorKind, Refused
from ..engines.lexicon import request_entries
from ..service import AudioOutput, Stream, StreamRequest
from ..service.events import Audio, Ended, Failed, Segment, Words
from ..service.validation import MAX_INSTRUCTIONS_CHARS, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, check_options
from ..service.voices.names import with_speaker
from . import protocol as p
from .auth import is_authorized, origin_allowed, owner
from .body import BadJson, BodyTooLarge, parse_json, read_body
from .connections import CUT_EXTENSION
from .errors import HTTP_STATUS, ORIGIN_REFUSED, listing_refusal, retry_headers
from .spool import SendClock, Spool
from .state import ServerState, server_state

log = logging.getLogger("vox_ws.openai")

RESPONSE_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
# OpenAI's speech API sends every format at 24 kHz unless the body asks otherwise.
DEFAULT_RATE = 24_000
# Model names clients send by default (OpenAI's, and Kokoro-FastAPI's, whose guides set up Open
# WebUI); all mean the served model, as do OpenAI's dated snapshots (gpt-4o-mini-tts-2025-12-15,
# tts-1-1106) and the names in `--model-aliases`. Any other name is served too, and said ignored.
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "kokoro")
_OPENAI_MODEL = re.compile(r"(?:tts-1|tts-1-hd|gpt-4o-mini-tts)(?:-\d{4}-\d{2}-\d{2}|-\d{4})?|kokoro")
# Kokoro's one-letter `lang_code`s, as the language tags they stand for.
KOKORO_LANG_CODES = {"a": "en-US", "b": "en-GB", "e": "es", "f": "fr", "h": "hi", "i": "it", "j": "ja", "p": "pt-BR",
                     "z": "zh"}
# Kokoro-FastAPI's `normalization_options`: `normalize` is the engine's option of that name
# (where it has one); the others name normalisations this server does not make, reported ignored.
KOKORO_NORMALIZATIONS = ("normalize", "unit_normalization", "url_normalization", "email_normalization",
                         "optional_pluralization_normalization", "phone_normalization", "replace_remaining_symbols")
CONTENT_TYPES = {"pcm": "audio/pcm", **{name: CODECS[name].content_type for name in RESPONSE_FORMATS
                                         if name in CODECS}}
# Kokoro-FastAPI's fields for a file kept on its server to fetch later (`return_download_link`, in
# `download_format`): this server keeps nothing, so they are taken and said ignored, not refused.
KOKORO_DOWNLOAD_FIELDS = ("download_format", "return_download_link")
KNOWN_FIELDS = {"model", "input", "voice", "response_format", "speed", "instructions", "stream_format",
                "sample_rate", "lookahead_s", "markup", "pronunciations", "lora", "language", "lang_code", "volume",
                "volume_multiplier", "stream", "normalization_options", "timestamps", "speaker",
                *KOKORO_DOWNLOAD_FIELDS}
TIMESTAMPS = ("word", "segment")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 501: "invalid_request_error",
               503: "service_unavailable_error"}
NO_STORE = {"Cache-Control": "no-store"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def from_refused(cls, err: Refused, param: str | None = None) -> "OpenAIError":
        return cls(HTTP_STATUS[err.kind], err.message, param, p.code_for(err.kind), retry_headers(err))

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers={**NO_STORE, **(self.headers or {})})


@dataclass(frozen=True)
class SpeechRequest:
    """A speech request: the stream's request for the service, and how this door answers it."""

    request: StreamRequest
    response_format: str
    sse: bool
    whole: bool = False                  # `stream: false` (a FLAC's default): the whole file in one response
    timestamps: str | None = None        # SSE: "word" or "segment" events beside the audio
    ignored: tuple[str, ...] = ()        # fields taken but without effect here


def _guard(request: Request, state: ServerState) -> None:
    """Raises OpenAIError for a request from an origin or without a key the server does not take."""
    config = state.config
    if not origin_allowed(request, config.allow_origins, config.cors_origins):
        raise OpenAIError(403, ORIGIN_REFUSED, code="origin_not_allowed")
    if not is_authorized(request, config.tokens, config.admin_tokens):
        raise OpenAIError(401, "Incorrect API key provided: present a valid token as `Authorization: Bearer`",
                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def speech(request: Request) -> Response:
    state = server_state(request)
    try:
        _guard(request, state)
        body = await _read_json(request, _body_limit(state))
        speech_request = parse_speech(body, state)
        who = _who(request, state)
        stream = _open(state, request, speech_request.request, who)
    except OpenAIError as err:
        return err.response()
    except ClientDisconnect:
        return Response(status_code=400)
    headers = {**NO_STORE, "X-Sample-Rate": str(stream.sample_rate), "X-Request-Id": stream.request_id}
    timestamps = speech_request.timestamps
    if timestamps == "word" and not stream.word_timestamps:
        timestamps = "segment"                 # the engine knows no word times: its segments'
    if timestamps:
        headers["X-Timestamps"] = timestamps
    # The service's answer, instructions first as this door always listed them.
    ignored = ["instructions"] if "instructions" in stream.ignored_options else []
    ignored += [*speech_request.ignored, *(o for o in stream.ignored_options if o != "instructions")]
    if ignored:
        headers["X-Ignored-Parameters"] = ",".join(ignored)
    media_type = "text/event-stream" if speech_request.sse else CONTENT_TYPES[speech_request.response_format]
    return SpeechResponse(stream, speech_request.sse, media_type, headers,
                          whole=Spool(state.spools, who, (state.limits.whole_min_rate,
                                                          state.limits.write_stall_timeout_s))
                          if speech_request.whole else None, timestamps=timestamps)


async def audio_models(request: Request) -> Response:
    """The served model as Kokoro-FastAPI lists TTS models (Open WebUI reads `models[].id`, and
    asks without a key: `listing_refusal`)."""
    state = server_state(request)
    if (refusal := listing_refusal(request, state.config)) is not None:
        return refusal
    card = _model_card(state)
    return JSONResponse({"models": [{**card, "name": card["id"]}]})


async def models(request: Request) -> Response:
    card = _guarded_card(request)
    return card if isinstance(card, Response) else JSONResponse({"object": "list", "data": [card]})


async def model(request: Request) -> Response:
    card = _guarded_card(request)
    if isinstance(card, Response):
        return card
    if request.path_params["model"] != card["id"] and not _OPENAI_MODEL.fullmatch(request.path_params["model"]):
        return OpenAIError(404, f"The model '{request.path_params['model']}' does not exist", "model",
                           "model_not_found").response()
    return JSONResponse(card)


ROUTES: list[BaseRoute] = [
    Route("/v1/audio/speech", speech, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/audio/models", audio_models, methods=["GET"]),
    Route("/v1/models/{model:path}", model, methods=["GET"]),
]


def _guarded_card(request: Request) -> dict[str, Any] | Response:
    """The served model's card, or the refusal of a request the server does not take."""
    state = server_state(request)
    try:
        _guard(request, state)
    except OpenAIError as err:
        return err.response()
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.service.engine
    return {"id": p.model_id(engine.model) or engine.name, "object": "model",
            "created": int(state.started_wall), "owned_by": "vox-ws"}


# The most bytes one character of a JSON string may take: a character beyond the BMP written as
# an escaped surrogate pair, \ud83d\ude00 (what json.dumps writes by default).
ESCAPED_CHAR_BYTES = 12


def _body_limit(state: ServerState) -> int:
    # Room for the longest text and instructions, every character escaped, and the other fields.
    return ESCAPED_CHAR_BYTES * (state.limits.max_text_chars + MAX_INSTRUCTIONS_CHARS) + 16_384


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise OpenAIError(415, f"Content-Type must be application/json, got {kind or 'none'!r}",
                          code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(413, f"body of {declared} bytes exceeds {limit} bytes", code="too_large")
    try:
        data = await read_body(request, limit)
    except BodyTooLarge:
        raise OpenAIError(413, f"body exceeds {limit} bytes", code="too_large") from None
    try:
        body = parse_json(data)
    except BadJson as exc:
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {exc}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the JSON body must be an object", code="invalid_json")
    return body


def parse_speech(body: dict[str, Any], state: ServerState) -> SpeechRequest:
    """Validate a speech request's body; raises OpenAIError naming the field at fault."""
    engine = state.service.engine
    specs = state.option_specs
    unknown = sorted(set(body) - KNOWN_FIELDS - set(specs))
    if unknown:
        raise OpenAIError(400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError(400, f"'model' must be a string, got {model!r}", "model", "invalid_value")
    # A model this server does not know by name is served all the same, and said ignored: a
    # client set up for another server (a guide's model name) speaks instead of failing.
    ignored_model = model is not None and model not in (engine.model, engine.name, p.model_id(engine.model),
                                                        *state.config.model_aliases) \
        and not _OPENAI_MODEL.fullmatch(model)
    # Each field's type here; the service's rules (the text's length, the ranges, the voice, ...)
    # run once as the stream opens, their refusals worded for this door (`service_error`).
    text = body.get("input")
    if not isinstance(text, str):
        raise OpenAIError(400, "'input' must be a non-empty string", "input", "invalid_value")
    try:
        voice = with_speaker(_voice(body.get("voice")), body.get("speaker"))
    except Refused as err:
        raise service_error(err) from None
    response_format = body.get("response_format", "mp3")
    if response_format not in RESPONSE_FORMATS:
        raise OpenAIError(400, f"'response_format' must be one of {list(RESPONSE_FORMATS)}, got {response_format!r}",
                          "response_format", "invalid_value")
    speed = _number(body, "speed", 1.0)
    stream_format = body.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise OpenAIError(400, f"'stream_format' must be 'audio' or 'sse', got {stream_format!r}", "stream_format",
                          "invalid_value")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise OpenAIError(400, "'instructions' must be a string", "instructions", "invalid_value")
    rate = body.get("sample_rate", DEFAULT_RATE)
    if isinstance(rate, bool) or not isinstance(rate, int) or not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise OpenAIError(400, f"'sample_rate' must be an integer from {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE}, "
                               f"got {rate!r}", "sample_rate", "invalid_value")
    codec = CODECS.get(response_format)
    if codec is not None and not codec.takes_rate(rate):
        raise OpenAIError(400, f"'{response_format}' takes sample rates {list(codec.rates or ())}, not {rate}",
                          "sample_rate", "invalid_value")
    lookahead = body.get("lookahead_s")                # its range is the stream service's rule
    if lookahead is not None and (isinstance(lookahead, bool) or not isinstance(lookahead, (int, float))):
        raise OpenAIError(400, f"'lookahead_s' must be a number of seconds, got {lookahead!r}", "lookahead_s",
                          "invalid_value")
    markup = body.get("markup")
    if markup is not None and markup not in ("ssml", "none"):
        raise OpenAIError(400, f"'markup' must be 'ssml' or 'none', got {markup!r}", "markup", "invalid_value")
    try:
        pronunciations = request_entries(body.get("pronunciations"))
    except Refused as err:
        raise OpenAIError.from_refused(err, "pronunciations") from None
    lora = body.get("lora")
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise OpenAIError(400, "'lora' must be the name of a loaded LoRA adapter", "lora", "invalid_value")
    raw_options = {name: body[name] for name in body if name in specs and name not in KNOWN_FIELDS}
    normalization, ignored = _normalization(body.get("normalization_options"))
    if ignored_model:
        ignored = ["model", *ignored]
    ignored += [name for name in KOKORO_DOWNLOAD_FIELDS if body.get(name) not in (None, False)]
    if normalization is not None and "normalize" in specs:
        raw_options.setdefault("normalize", normalization)
    try:
        options = check_options(raw_options, specs)
    except Refused as err:                             # OpenAI's options are top-level fields
        raise OpenAIError(400, err.message.replace("options.", ""), (err.field or "").removeprefix("options.")
                          or None, "invalid_value") from None
    language = _language(body)
    volume = _number(body, "volume" if "volume" in body else "volume_multiplier", 1.0)
    # A streamed FLAC cannot hold its length (its STREAMINFO goes first: total samples 0, which
    # libsndfile, soundfile's, cannot read), and OpenAI's SDK sends no `stream`, even to save a
    # file: without one, a FLAC comes whole with its length; `stream: true` streams it open-ended.
    streamed = body.get("stream", response_format != "flac" or stream_format == "sse")
    if not isinstance(streamed, bool):
        raise OpenAIError(400, f"'stream' must be a boolean, got {streamed!r}", "stream", "invalid_value")
    if not streamed and stream_format == "sse":
        raise OpenAIError(400, "'stream': false asks for one whole file; server-sent events stream", "stream",
                          "invalid_value")
    timestamps = body.get("timestamps")
    if timestamps is not None and timestamps not in TIMESTAMPS:
        raise OpenAIError(400, f"'timestamps' must be one of {list(TIMESTAMPS)}, got {timestamps!r}", "timestamps",
                          "invalid_value")
    if timestamps is not None and stream_format != "sse":
        raise OpenAIError(400, "'timestamps' come as server-sent events: send 'stream_format': 'sse' too",
                          "timestamps", "invalid_value")
    output = AudioOutput("s16" if response_format == "pcm" else response_format, rate, speed,
                         None if lookahead is None else float(lookahead), volume)
    request = StreamRequest(text, voice=voice, options=options, output=output,
                            instructions=instructions.strip() or None if instructions else None, markup=markup,
                            pronunciations=pronunciations, lora=lora, language=language,
                            word_timestamps=timestamps == "word")
    return SpeechRequest(request, response_format, stream_format == "sse", whole=not streamed,
                         ignored=tuple(ignored), timestamps=timestamps)


def _language(body: dict[str, Any]) -> str | None:
    """`language`, or Kokoro's `lang_code` (one of its letters, or a tag)."""
    field = "language" if "language" in body else "lang_code"
    value = body.get(field)
    if value is None:
        return None
    if field == "lang_code" and isinstance(value, str) and value.lower() in KOKORO_LANG_CODES:
        return KOKORO_LANG_CODES[value.lower()]
    return value                                       # its shape is the service's rule


def _normalization(value: Any) -> tuple[bool | None, list[str]]:
    """Kokoro's `normalization_options`: whether to normalise, and which of its fields have no effect."""
    if value is None:
        return None, []
    if not isinstance(value, dict):
        raise OpenAIError(400, "'normalization_options' must be an object", "normalization_options", "invalid_value")
    unknown = sorted(set(value) - set(KOKORO_NORMALIZATIONS))
    if unknown:
        raise OpenAIError(400, f"Unrecognized request argument supplied: normalization_options.{unknown[0]}",
                          f"normalization_options.{unknown[0]}", "unknown_parameter")
    for key, flag in value.items():
        if not isinstance(flag, bool):
            raise OpenAIError(400, f"'normalization_options.{key}' must be a boolean", f"normalization_options.{key}",
                              "invalid_value")
    return value.get("normalize"), [f"normalization_options.{key}" for key in sorted(value) if key != "normalize"]


def _voice(value: Any) -> str | None:
    """OpenAI's `voice`: a name, or an object with its `id` (a built-in voice, an alias, a
    registered id or name: the stream service resolves it, once)."""
    if isinstance(value, dict):
        value = value.get("id")
    if value is not None and (not isinstance(value, str) or not value):
        raise OpenAIError(400, "'voice' must be a voice id (a string, or an object with 'id')", "voice",
                          "invalid_value")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpenAIError(400, f"'{name}' must be a number, got {value!r}", name, "invalid_value")
    return float(value)


# The stream service names a request's fields as `StreamRequest` does; this door as OpenAI does.
_OPENAI_FIELDS = {"text": "input"}


def service_error(err: Refused) -> OpenAIError:
    """A refusal of the stream service (its rules, its voices, its queue) in OpenAI's words: the
    field at fault as `param`, an unknown voice as `voice_not_found`."""
    param = _OPENAI_FIELDS.get(err.field or "", err.field)
    if err.field is None or err.kind not in (ErrorKind.INVALID, ErrorKind.TOO_LARGE):
        return OpenAIError.from_refused(err, param)
    message = err.message.replace(f"field '{err.field}'", f"field '{param}'", 1)
    code = "too_large" if err.kind is ErrorKind.TOO_LARGE else \
        "voice_not_found" if err.field == "voice" else "invalid_value"
    return OpenAIError(HTTP_STATUS[err.kind], message, param, code)


def _who(request: Request, state: ServerState) -> str:
    return owner(request, state.config.tokens, state.config.admin_tokens, state.config.ipv6_prefix)


def _open(state: ServerState, request: Request, speech: StreamRequest, who: str) -> Stream:
    if state.draining:
        raise OpenAIError(503, "server shutting down", code="going_away", headers={"Retry-After": "1"})
    client = request.client.host if request.client is not None else "unknown"
    try:
        return state.service.open_stream(speech, owners=(who, f"http:{id(request)}"),
                                         log_fields={"http": client})
    except Refused as err:
        raise service_error(err) from None


class SpeechResponse(Response):
    """Streams a stream's audio as the body (chunked), or as server-sent events.

    The status line waits for the first event, so a stream that fails before its first audio
    gets its own status. A client that goes away closes the stream at once (its slot is free
    before the next step). A stream that fails after its first bytes ends the connection
    without the chunked terminator, so a client sees a truncated body, never a short file
    that looks whole (SSE: an `error` event first)."""

    def __init__(self, stream: Stream, sse: bool, media_type: str, headers: dict[str, str],
                 whole: Spool | None = None, timestamps: str | None = None) -> None:
        # No body and no Content-Length: the response is chunked (Starlette's StreamingResponse
        # sets itself up the same way).
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self.stream = stream
        self.sse = sse
        self.whole = whole                 # one body with its length, held here until all is spoken
        self.timestamps = timestamps       # SSE: "word" or "segment" events beside the audio

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await self._respond(send)
        except _StreamBroke:
            cut = scope.get("extensions", {}).get(CUT_EXTENSION)
            if cut is None:
                raise                                    # another server: dropping it is its own to do
            cut()                                        # said in one warning already, no traceback
        except OSError:
            pass                                         # the client went away mid-write
        finally:
            watcher.cancel()
            self.stream.close()
            if self.whole is not None:
                await self.whole.close()

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.stream.close()
                return

    async def _respond(self, send: Send) -> None:
        events = aiter(self.stream)
        first = await anext(events, None)
        if first is None:
            return                                       # closed: the client is gone
        if isinstance(first, Failed):
            refusal = Refused(first.kind, first.message, first.retry_after_s, first.field)
            await service_error(refusal).response()({"type": "http"}, _no_receive, send)
            return
        if self.whole is not None:
            await self._respond_whole(send, first, events, self.whole)
            return
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        started = time.monotonic()
        event = first
        while event is not None:
            if isinstance(event, Audio):
                await self._body(send, self._frame(event))
            elif isinstance(event, Words) and self.timestamps == "word":
                await self._body(send, _sse({"type": "speech.audio.words", "words": p.timed_words(event)}))
            elif isinstance(event, Segment) and self.timestamps:
                await self._body(send, _sse({"type": "speech.audio.segment", "index": event.index, "text": event.text,
                                             "start_s": event.start_s, "end_s": event.end_s}))
            elif isinstance(event, Ended):
                if self.sse:
                    await self._body(send, _sse({"type": "speech.audio.done", "usage": _usage(event.stats)}))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            elif isinstance(event, Failed):
                log.warning("speech stream failed after %.1fs of response: %s: %s", time.monotonic() - started,
                            event.kind.value, event.message)
                if self.sse:
                    await self._body(send, _sse({"type": "error", "error": {
                        "message": event.message, "type": ERROR_TYPES.get(HTTP_STATUS[event.kind], "server_error"),
                        "param": None, "code": p.code_for(event.kind)}}))
                raise _StreamBroke(event.message)
            event = await anext(events, None)

    async def _respond_whole(self, send: Send, event: Any, events: Any, spool: Spool) -> None:
        """`stream: false`: the whole file, with its Content-Length, or the failure's own status;
        held in `spool` meanwhile, then sent as fast as the client reads it."""
        while event is not None and not isinstance(event, Ended):
            if isinstance(event, Failed):
                refusal = Refused(event.kind, event.message, event.retry_after_s)
                await OpenAIError.from_refused(refusal).response()({"type": "http"}, _no_receive, send)
                return
            if isinstance(event, Audio):
                try:
                    await spool.write(event.data)
                except Refused as err:
                    self.stream.close()
                    await spool.close()                  # its bytes are free before the answer
                    await OpenAIError.from_refused(err).response()({"type": "http"}, _no_receive, send)
                    return
            event = await anext(events, None)
        if event is None:
            return                                       # closed: the client is gone
        for offset, data in event.rewrites:              # the header's lengths, known now (FLAC, WAV)
            spool.rewrite(offset, data)
        headers = [*self.raw_headers, (b"content-length", str(spool.size).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        loop = asyncio.get_running_loop()
        floor = spool.send_floor(event.stats.get("audio_s"))
        clock = SendClock(*floor, loop.time())
        sent = 0
        async for piece in spool.pieces():
            try:
                # The transport's flow control holds this send until the client has taken the one before.
                await asyncio.wait_for(self._body(send, piece), clock.left_s(loop.time()))
            except asyncio.TimeoutError:
                log.warning("whole response taken slower than %.0f bytes a second: closed after %d of %d "
                            "bytes", floor[0], sent, spool.size)
                raise _StreamBroke("the client took the whole file too slowly") from None
            sent += len(piece)
            clock.taken(len(piece), loop.time())
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _frame(self, audio: Audio) -> bytes:
        if not self.sse:
            return audio.data
        return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(audio.data).decode("ascii")})

    @staticmethod
    async def _body(send: Send, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})


class _StreamBroke(Exception):
    """The response, started, cannot be finished: its connection is dropped unfinished
    (`connections.CUT_EXTENSION`; under another server, raised to it)."""


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _usage(stats: dict[str, Any]) -> dict[str, Any]:
    """The stream's usage (characters taken in, audio sent, chunks), and OpenAI's token fields
    for clients that read those: characters in, chunks out."""
    usage = stats["usage"]
    return {**usage, "input_tokens": usage["characters"], "output_tokens": usage["chunks"],
            "total_tokens": usage["characters"] + usage["chunks"]}
