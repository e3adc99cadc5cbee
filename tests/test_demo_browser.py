"""The browser demo in a real browser: headless Chromium (Debian's package) driven by Playwright,
against a real server with the Piper voice. Assertions come from the page's own state."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import CHROMIUM, LAUNCH_ARGS

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

pytestmark = pytest.mark.browser

LONG = " ".join(f"Sentence number {i} keeps the voice talking for a little while." for i in range(1, 10))


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is not installed (scripts/test.sh installs Debian's chromium)")

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_page(browser, piper_server):
    """Opens the demo on the Piper server (a WebSocket route, if given, is set before the page
    loads); at the end, fails the test if the page logged an error or threw."""
    opened = []

    def open_(route_socket=None):
        context = browser.new_context(viewport={"width": 1100, "height": 760})
        page = context.new_page()
        messages = []
        page.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: messages.append(f"pageerror: {e}"))
        if route_socket is not None:
            page.route_web_socket("**/v1/stream*", route_socket)
        page.goto(piper_server.http + "/")
        page.wait_for_function("window.voxDemo && window.voxDemo.state.ready", timeout=30_000)
        opened.append((context, messages))
        return page

    yield open_
    errors = []
    for context, messages in opened:
        errors += [m for m in messages if m.startswith(("pageerror", "error"))]
        context.close()
    assert not errors, errors


@pytest.fixture
def page(open_page):
    return open_page()


def state(page):
    return page.evaluate("""() => {
        const s = window.voxDemo.state;
        return {
          stream: s.stream, lastEnd: s.lastEnd, lastError: s.lastError, player: s.player,
          contextRate: s.contextRate, drained: s.drained, hello: s.hello,
        };
    }""")


def assert_no_underrun_of_the_pages_own(s: dict) -> None:
    """The page never ran dry while it held audio. Where the voice falls behind real time (a
    slow or loaded machine), the player waits for the server, and the page says so: such an
    underrun is the source's (`sourceLate`), which the page cannot help."""
    assert s["player"]["underruns"] == s["player"]["sourceLate"], s["player"]


@pytest.mark.parametrize("fmt", ["opus_packets", "f32"])
def test_page_plays_the_audio_live_without_underruns(page, fmt):
    page.wait_for_function("window.voxDemo.state.webCodecs !== null")
    # Chromium has WebCodecs: the page picks Opus by itself.
    assert page.evaluate("window.voxDemo.state.webCodecs") is True
    assert page.input_value("#format") == "opus_packets"
    page.select_option("#format", fmt)
    page.fill("#text", "Hello from the browser. This audio plays while it is being generated, "
                       "one sentence after another.")
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.player.played > 24000 && window.voxDemo.state.player.playing",
                           timeout=60_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"demo-playing-{fmt}.png"), full_page=True)
    page.wait_for_function("window.voxDemo.state.stream && window.voxDemo.state.stream.ended", timeout=60_000)
    page.wait_for_function("window.voxDemo.state.drained", timeout=60_000)
    s = state(page)
    assert s["lastEnd"]["reason"] == "done", s["lastEnd"]
    received_s = s["stream"]["samples"] / s["stream"]["rate"]
    played_s = s["player"]["played"] / s["contextRate"]
    assert s["stream"]["format"] == fmt
    assert received_s > 2.0
    assert received_s == pytest.approx(s["lastEnd"]["audio_s"], rel=0.01)
    # Every sample the server sent was played: nothing dropped, nothing repeated (Opus: less
    # the pre-skip, if the decoder drops it).
    delay_s = s["stream"]["preSkip"] / 48000 if fmt == "opus_packets" else 0.0
    assert played_s == pytest.approx(received_s - delay_s, abs=0.02)
    rms = (s["player"]["sumSquares"] / max(1, s["player"]["played"])) ** 0.5
    assert rms > 0.01, "the worklet played silence"
    assert_no_underrun_of_the_pages_own(s)
    # The page shows what the codec saves.
    bits = s["stream"]["bytes"] * 8 / received_s
    assert (bits < 64_000) if fmt == "opus_packets" else (bits > 500_000)
    assert "kbit/s" in page.inner_text("#stat-bitrate")
    page.screenshot(path=str(ARTIFACTS / f"demo-{fmt}.png"), full_page=True)


def test_a_rate_other_than_the_context_is_resampled_in_the_page(page):
    page.select_option("#rate", "16000")
    page.select_option("#format", "s16")
    page.fill("#text", "Sixteen kilohertz, resampled in the browser.")
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.stream && window.voxDemo.state.stream.ended "
                           "&& window.voxDemo.state.drained", timeout=60_000)
    s = state(page)
    assert s["stream"]["rate"] == 16000 and s["contextRate"] != 16000
    received_s = s["stream"]["samples"] / 16000
    assert s["player"]["played"] / s["contextRate"] == pytest.approx(received_s, abs=0.02)
    assert_no_underrun_of_the_pages_own(s)


def test_stop_cancels_at_once(page):
    page.fill("#text", LONG)
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.player.played > 4000", timeout=60_000)
    page.click("#stop")
    page.wait_for_function("window.voxDemo.state.lastEnd !== null", timeout=30_000)
    s = state(page)
    assert s["lastEnd"]["reason"] == "cancelled"
    assert s["player"]["buffered"] == 0 or page.evaluate("window.voxDemo.state.player.buffered") == 0
    assert "Stopped" in page.inner_text("#message")


@pytest.mark.parametrize("fmt", ["opus_packets", "s16"])
def test_audio_arriving_after_stop_is_dropped_quietly(open_page, fmt):
    """The server's chunks already on the wire when Stop is clicked still arrive: the page must
    drop them (an Opus decoder reset by Stop once threw on them). The route makes that race
    certain: on the page's cancel it first replays the stream's last chunk, then forwards it."""
    import msgpack

    seen = {"chunk": None, "late": 0}

    def route(ws):
        server = ws.connect_to_server()

        def from_server(message):
            if isinstance(message, bytes) and msgpack.unpackb(message).get("type") == "chunk":
                seen["chunk"] = message
            ws.send(message)

        def from_page(message):
            if isinstance(message, bytes) and msgpack.unpackb(message).get("type") == "cancel":
                if seen["chunk"] is not None:
                    ws.send(seen["chunk"])
                    seen["late"] += 1
            server.send(message)

        server.on_message(from_server)
        ws.on_message(from_page)

    page = open_page(route)
    page.select_option("#format", fmt)
    page.fill("#text", LONG)
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.player.played > 4000", timeout=60_000)
    # One task of the page's: nothing it receives can come between the click and the count.
    chunks_at_stop = page.evaluate("""() => {
        document.getElementById('stop').click();
        return window.voxDemo.state.stream.chunks;
    }""")
    page.wait_for_function("window.voxDemo.state.lastEnd !== null", timeout=30_000)
    assert seen["late"] == 1
    s = state(page)
    assert s["lastEnd"]["reason"] == "cancelled"
    assert s["stream"]["chunks"] == chunks_at_stop       # the late chunk was not taken in
    page.wait_for_function("window.voxDemo.state.player.buffered === 0", timeout=5_000)
    # The page speaks again after it (the fixture fails the test on any page error).
    page.fill("#text", "And again.")
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.lastEnd && window.voxDemo.state.lastEnd.reason === 'done'",
                           timeout=60_000)


def test_errors_are_shown_in_words(page):
    page.fill("#text", "x" * 6000)          # over the server's max_text_chars
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.lastError !== null", timeout=30_000)
    assert "too long" in page.inner_text("#message")
    assert state(page)["lastError"]["code"] == "too_large"


def test_page_reconnects_after_the_server_restarts(browser, start_server):
    import socket

    from vox_ws.engines.piper import PiperEngine

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = start_server(PiperEngine(), port=port)
    context = browser.new_context()
    page = context.new_page()
    page.goto(server.http + "/")
    page.wait_for_function("window.voxDemo.state.ready", timeout=30_000)
    server.stop()                                       # the server goes away...
    page.wait_for_function("!window.voxDemo.state.connected", timeout=10_000)
    # The page says it retries (between two tries it says "connecting…" for a moment).
    page.wait_for_function("document.getElementById('connection-text').textContent.includes('retrying')",
                           timeout=10_000)
    restarted = start_server(PiperEngine(), port=port)  # ...and comes back on the same port
    page.wait_for_function("window.voxDemo.state.ready", timeout=30_000)
    assert "connected" in page.inner_text("#connection-text")
    page.fill("#text", "Back again.")
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.lastEnd && window.voxDemo.state.lastEnd.reason === 'done'",
                           timeout=60_000)
    assert restarted.port == port
    context.close()


def test_clone_my_voice_from_a_file_then_speak_with_it(browser, start_server, tiny_model, tmp_path):
    """With VoxCPM2 the page registers a voice from a picked file and speaks with it."""
    import numpy as np
    import soundfile

    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), slots=2)
    wav = tmp_path / "me.wav"
    t = np.arange(int(1.5 * 22050)) / 22050
    soundfile.write(wav, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 22050)
    context = browser.new_context()
    page = context.new_page()
    page.goto(server.http + "/")
    page.wait_for_function("window.voxDemo.state.ready", timeout=30_000)
    page.click("#clone summary")
    page.set_input_files("#clone-file", str(wav))
    page.fill("#clone-transcript", "this is my voice")
    page.fill("#clone-name", "Kitchen voice")
    page.wait_for_selector("#clone-upload:not([disabled])")
    page.click("#clone-upload")
    page.wait_for_function("document.getElementById('voice').value === 'Kitchen voice'", timeout=30_000)
    assert "Your voice is selected" in page.inner_text("#clone-status")
    s = speak_and_drain(page, "Hi.")
    assert s["lastEnd"]["reason"] == "max_len"          # the tiny model speaks to its length cap
    assert s["stream"]["rate"] == s["contextRate"] or s["stream"]["rate"] <= 48000
    assert s["player"]["played"] / s["contextRate"] == pytest.approx(s["lastEnd"]["audio_s"], abs=0.02)
    # After a reload the server lists the voice among this client's own.
    page.reload()
    page.wait_for_function("window.voxDemo.state.ready", timeout=30_000)
    page.wait_for_function("[...document.querySelectorAll('#voice optgroup[label=\"my voices\"] option')]"
                           ".some(o => o.value === 'Kitchen voice')", timeout=10_000)
    # A voice another client (another address) registered public is offered too, by its name.
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as other:
        shared = other.post(server.http + "/v1/voices", params={"name": "Shared voice", "public": "true"},
                            content=wav.read_bytes(), headers={"content-type": "audio/wav"})
    assert shared.status_code == 201, shared.text
    page.reload()
    page.wait_for_function("window.voxDemo.state.ready", timeout=30_000)
    page.wait_for_function("[...document.querySelectorAll('#voice optgroup[label=\"shared voices\"] option')]"
                           ".some(o => o.value === 'Shared voice')", timeout=10_000)
    # VoxCPM2 follows instructions: with no voice chosen, they design one.
    assert page.is_enabled("#instructions") and "voice design" in page.inner_text("#instructions-note")
    page.select_option("#voice", "")
    page.fill("#instructions", "a warm, low voice, slowly")
    s = speak_and_drain(page, "Hi.")
    assert (s["stream"]["request"]["instructions"] == "a warm, low voice, slowly"
            and "voice" not in s["stream"]["request"])
    assert s["lastEnd"]["reason"] == "max_len" and "instructions" not in s["stream"]["ignored"]
    # VoxCPM2 times no words itself: the aligner does, and the captions are its words.
    assert s["stream"]["request"].get("word_timestamps") is True
    assert page.eval_on_selector_all("#captions span", "els => els.map(e => e.textContent)") == ["Hi."]
    context.close()


def test_the_picker_lists_aliases_and_my_voices_and_a_voice_of_mine_is_deleted(browser, start_server,
                                                                                tiny_model, tmp_path):
    """The picker listed built-in voices only: none of VoxCPM2's 13 designed voices (OpenAI's
    names), none of the aliases file's, and the page could neither list nor delete the voices
    its visitor registered. Each alias is named as itself and says what it stands for; the
    visitor's voices are listed with a Delete button, which deletes the voice on the server."""
    import httpx
    import numpy as np
    import soundfile

    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    aliases = tmp_path / "aliases.toml"
    aliases.write_text("quick = { speed = 1.25 }\n")
    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), slots=2,
                          voice_aliases=str(aliases))
    wav = tmp_path / "me.wav"
    t = np.arange(int(1.5 * 22050)) / 22050
    soundfile.write(wav, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 22050)
    context = browser.new_context()
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(server.http + "/")
    page.wait_for_function("window.voxDemo.state.ready", timeout=30_000)
    page.wait_for_function("window.voxDemo.state.voices.some(v => v.kind === 'alias')", timeout=10_000)
    aliases_listed = page.eval_on_selector_all('#voice optgroup[label="aliases"] option',
                                               "os => Object.fromEntries(os.map(o => [o.value, o.text]))")
    assert aliases_listed["nova"] == "nova · designed voice"
    assert aliases_listed["quick"] == "quick · alias of the default voice, 1.25× speed"
    assert len(aliases_listed) == 14                                # OpenAI's 13 names and the file's
    assert page.is_hidden("#my-voices-box")
    # An alias is a voice to speak with, by its name (stopped at its first audio: the tiny model
    # speaks to its length cap, a minute of audio to play).
    page.select_option("#voice", "nova")
    page.fill("#text", "Hi.")
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.stream && window.voxDemo.state.stream.chunks > 0", timeout=60_000)
    page.click("#stop")
    page.wait_for_function("window.voxDemo.state.lastEnd !== null", timeout=30_000)
    assert state(page)["stream"]["request"]["voice"] == "nova" and state(page)["lastError"] is None

    page.click("#clone summary")
    page.set_input_files("#clone-file", str(wav))
    page.fill("#clone-name", "Kitchen voice")
    page.wait_for_selector("#clone-upload:not([disabled])")
    page.click("#clone-upload")
    page.wait_for_function("document.getElementById('voice').value === 'Kitchen voice'", timeout=30_000)
    mine = '#voice optgroup[label="my voices"] option'
    assert page.eval_on_selector_all(mine, "os => os.map(o => o.value)") == ["Kitchen voice"]
    names = page.eval_on_selector_all("#my-voices li .name", "els => els.map(e => e.textContent)")
    assert names == ["Kitchen voice"]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-my-voices.png"), full_page=True)
    listed = httpx.get(server.http + "/v1/audio/voices", timeout=10).json()["uploaded_voices"]
    assert [v["name"] for v in listed] == ["Kitchen voice"]
    # Deleted from the page: gone from its lists and from the server's.
    page.click(f'#my-voices button[data-voice="{listed[0]["voice_id"]}"]')
    page.wait_for_function("window.voxDemo.state.deleted.length === 1 "
                           "&& !window.voxDemo.state.voices.some(v => v.kind === 'uploaded')", timeout=30_000)
    deleted = page.evaluate("window.voxDemo.state.deleted")
    assert deleted == [{"voice": listed[0]["voice_id"], "deleted": True}]
    assert page.eval_on_selector_all(mine, "os => os.length") == 0 and page.is_hidden("#my-voices-box")
    assert page.input_value("#voice") == ""                        # the default voice, chosen again
    assert "Deleted Kitchen voice." in page.inner_text("#clone-status")
    assert httpx.get(server.http + "/v1/audio/voices", timeout=10).json()["uploaded_voices"] == []
    context.close()
    assert not errors, errors


# ------------------------------------------------------------------------------ what the model can do


def recording_route(sent: list):
    """A WebSocket route that forwards both ways and keeps what the page sent (decoded)."""
    import msgpack

    def route(ws):
        server = ws.connect_to_server()

        def from_page(message):
            if isinstance(message, bytes):
                sent.append(msgpack.unpackb(message))
            server.send(message)

        server.on_message(ws.send)
        ws.on_message(from_page)

    return route


def speak_and_drain(page, text: str) -> dict:
    page.fill("#text", text)
    page.click("#speak")
    page.wait_for_function("window.voxDemo.state.stream && window.voxDemo.state.stream.ended "
                           "&& window.voxDemo.state.drained", timeout=60_000)
    return state(page)


def test_speed_and_ssml_change_what_is_spoken_and_piper_says_it_ignores_instructions(open_page):
    sent: list = []
    page = open_page(recording_route(sent))
    # Piper follows no instructions: the page says so instead of sending them.
    assert page.is_disabled("#instructions")
    assert "does not follow" in page.inner_text("#instructions-note")
    page.select_option("#format", "f32")
    text = "The quick brown fox jumps over the lazy dog."
    normal = speak_and_drain(page, text)["lastEnd"]["audio_s"]
    page.fill("#speed", "2")                       # the range input: sets it and fires `input`
    assert page.inner_text("#speed-value") == "2.00×"
    fast = speak_and_drain(page, text)["lastEnd"]["audio_s"]
    assert fast == pytest.approx(normal / 2, rel=0.1)
    page.fill("#speed", "1")
    page.check("#ssml")
    marked = speak_and_drain(page, 'One.<break time="1500ms"/>Two.')["lastEnd"]
    page.uncheck("#ssml")
    plain = speak_and_drain(page, "One. Two.")["lastEnd"]
    assert marked["reason"] == "done" and "<" not in " ".join(seg["text"] for seg in marked["segments"])
    assert marked["audio_s"] > plain["audio_s"] + 1.4           # the break is exact silence
    starts = [m for m in sent if m["type"] == "start"]
    assert [m.get("speed") for m in starts] == [None, 2.0, None, None]
    assert [m["markup"] for m in starts] == ["none", "none", "ssml", "none"]
    assert not any("instructions" in m for m in starts)


def test_streaming_like_an_llm_sends_word_by_word_and_captions_light_each_word(open_page):
    sent: list = []
    page = open_page(recording_route(sent))
    page.select_option("#format", "f32")
    page.check("#llm")
    assert page.is_disabled("#ssml")                 # a text streamed in is plain
    text = "Streaming like a language model, one word at a time. The captions follow along."
    page.fill("#text", text)
    page.click("#speak")
    page.wait_for_function("document.getElementById('stat-ttfa-label').textContent === 'first audio, 1st word'")
    # A word lights up while the audio plays, and it moves on.
    page.wait_for_selector("#captions span.now", timeout=60_000)
    first_lit = page.evaluate("window.voxDemo.state.captionIndex")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-captions.png"), full_page=True)    # the README's picture
    page.wait_for_function(f"window.voxDemo.state.captionIndex > {first_lit}", timeout=60_000)
    page.wait_for_function("window.voxDemo.state.stream.ended && window.voxDemo.state.drained", timeout=60_000)
    s = state(page)
    assert s["lastEnd"]["reason"] == "done"
    assert s["stream"]["words"] == {"sent": len(text.split()), "total": len(text.split())}
    assert s["stream"]["firstAudioAt"] is not None and "ms" in page.inner_text("#stat-ttfa")
    start = next(m for m in sent if m["type"] == "start")
    assert start["stream_input"] is True and "text" not in start and start["word_timestamps"] is True
    chunks = [m["text"] for m in sent if m["type"] == "chunk"]
    assert [c.strip() for c in chunks] == text.split() and sent[-1]["type"] == "end"
    # Piper's word timings: every word, in order; all heard once the audio has played out.
    assert page.eval_on_selector_all("#captions span", "els => els.map(e => e.textContent)") == text.split()
    page.wait_for_function("document.querySelectorAll('#captions span.spoken').length === "
                           f"{len(text.split())} && !document.querySelector('#captions span.now')")


def test_downloads_hold_what_was_spoken_as_wav_and_as_the_servers_opus(page, tmp_path):
    import wave

    import av

    page.select_option("#format", "opus_packets")
    assert page.is_disabled("#download-wav") and page.is_disabled("#download-opus")
    s = speak_and_drain(page, "Download what you heard, as a file of its own.")
    audio_s = s["lastEnd"]["audio_s"]
    page.wait_for_selector("#download-opus:not([disabled])")
    with page.expect_download() as opus_download:
        page.click("#download-opus")
    with page.expect_download() as wav_download:
        page.click("#download-wav")
    opus_path, wav_path = tmp_path / "said.opus", tmp_path / "said.wav"
    opus_download.value.save_as(opus_path)
    wav_download.value.save_as(wav_path)
    assert opus_download.value.suggested_filename.endswith(".opus")
    with av.open(str(opus_path)) as container:            # FFmpeg reads the page's Ogg file
        stream = container.streams.audio[0]
        assert stream.codec_context.name == "opus"
        decoded = sum(frame.samples for frame in container.decode(audio=0)) / 48000
    assert decoded == pytest.approx(audio_s, abs=0.03)
    with wave.open(str(wav_path)) as w:
        assert w.getframerate() == 48000 and w.getnchannels() == 1
        assert w.getnframes() / 48000 == pytest.approx(audio_s, abs=0.03)
    # PCM formats have no Opus packets to give: WAV only.
    page.select_option("#format", "s16")
    speak_and_drain(page, "Plain PCM this time.")
    page.wait_for_selector("#download-wav:not([disabled])")
    assert page.is_disabled("#download-opus")


def test_a_token_is_typed_once_kept_in_the_tab_and_never_in_the_address(browser, start_server):
    from vox_ws.engines.piper import PiperEngine

    server = start_server(PiperEngine(), tokens=["s3cret-é"])
    context = browser.new_context()
    page = context.new_page()
    handshakes = []
    page.on("websocket", lambda ws: handshakes.append(ws.url))
    # An old link with the token in it: the page moves it out of the address at once.
    page.goto(server.http + "/?token=wrong")
    assert "token" not in page.url
    page.wait_for_selector("#token-form:not([hidden])", timeout=30_000)
    assert "refused" in page.inner_text("#connection-text")
    page.fill("#token", "s3cret-é")
    page.click("#token-connect")
    page.wait_for_function("window.voxDemo.state.ready", timeout=30_000)
    assert page.evaluate("sessionStorage.getItem('vox-ws.token')") == "s3cret-é"
    # The page's HTTP requests carry it too: the voices came from /v1/audio/voices (only it lists
    # aliases and languages; without the token it answers 401 and the page keeps `hello`'s names).
    page.wait_for_function("window.voxDemo.state.voices.some(v => v.kind === 'alias')", timeout=10_000)
    groups = page.eval_on_selector_all("#voice optgroup", "groups => groups.map(g => g.label)")
    assert groups == ["voices", "aliases"]
    page.reload()                                        # the same tab: no typing again
    page.wait_for_function("window.voxDemo.state.ready", timeout=30_000)
    assert page.is_hidden("#token-form")
    speak_and_drain(page, "Authorised.")
    assert all("token" not in url for url in handshakes) and "token" not in page.url
    context.close()
