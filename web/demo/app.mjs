// vox-ws demo: speaks what you type while it is being generated.
//
// WebSocket + msgpack (protocol v1) in, an AudioWorklet ring buffer out. The AudioContext is
// created or resumed inside the click, before any await, as browsers require. Audio comes as
// Opus packets decoded by WebCodecs' AudioDecoder where the browser has it (a twentieth of the
// bytes of 16-bit PCM), else as raw PCM. What was spoken is kept for a download (WAV, or the
// server's own Opus packets in an Ogg file), and its words are shown as they are heard.
//
// A token never goes in the address: it is typed once, kept in session storage (this tab,
// until it closes) and offered as the WebSocket subprotocol `vox-ws.bearer.<base64url>`, and as
// `Authorization` on the page's HTTP requests.

import { decode, encode } from "./vendor/msgpack/index.mjs";
import { CaptionTrack } from "./captions.mjs";
import { closeReason } from "./close-codes.mjs";
import { oggOpus } from "./ogg-opus.mjs";
import { Resampler } from "./resampler.mjs";
import { ownVoiceNote, voiceGroups, voiceLabel } from "./voices.mjs";
import { encodeWav } from "./wav.mjs";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
const TOKEN_KEY = "vox-ws.token";
// "Stream like an LLM": a word every this many milliseconds (20 words a second, a fast model).
const WORD_INTERVAL_MS = 50;
// What a download holds at most; the stream itself may go on longer.
const MAX_RECORD_S = 600;

const ERROR_WORDS = {
  bad_frame: "The server could not read a message.",
  bad_request: "The request was not valid.",
  unknown_stream: "That stream has already ended.",
  duplicate_stream: "A stream with that id is already playing.",
  too_large: "That is too long.",
  too_many_streams: "Too many streams are open on this connection.",
  busy: "The server is busy right now; try again in a moment.",
  not_ready: "The model is still loading; try again in a moment.",
  timeout: "The stream timed out.",
  internal: "The server failed while generating this audio.",
  slow_consumer: "Audio could not be delivered fast enough.",
  unsupported: "The server cannot do that.",
  unauthorized: "Not authorised.",
  rate_limited: "Too many requests; slow down a little.",
  going_away: "The server is restarting.",
  unavailable: "The server's model stopped working; try again in a moment.",
};

// Everything a person or a test may want to know about the page, in one place.
const state = {
  connected: false,      // the socket is open and `hello` has arrived
  ready: false,          // ... and the server's engine is loaded
  hello: null,
  contextRate: null,
  stream: null,          // the stream being spoken: {id, rate, format, sentAt, firstAudioAt, chunks, samples, bytes, ended}
  webCodecs: null,       // whether this browser decodes Opus with WebCodecs (null: not known yet)
  lastEnd: null,
  lastError: null,
  player: { played: 0, underruns: 0, sourceLate: 0, buffered: 0, sumSquares: 0, peak: 0, playing: false },
  drained: true,
  voices: [],            // as /v1/audio/voices lists them: {id, name, kind: builtin | alias | uploaded | public}
  deleted: [],           // the answers to this page's voice deletions: {voice, deleted}
  needsToken: false,     // the server refused this page's token (or its lack of one)
  captions: null,        // the CaptionTrack of the stream being played, when captions are on
  captionIndex: -1,      // the caption item being heard
  captionsDone: false,   // ... or all of them heard
  downloads: [],         // what the page offered for download: {name, bytes}
};
window.voxDemo = { state };

let ws = null;
let reconnectDelay = 500;
let ctx = null;
let player = null;
let playerReady = null;
let resampler = null;
let streamCounter = 0;
let requestCounter = 0;
let pendingVoiceAudio = null;
let decoder = null;      // the WebCodecs AudioDecoder of the Opus stream being played

const OPUS = "opus_packets";
const OPUS_RATES = [8000, 12000, 16000, 24000, 48000];

async function detectWebCodecsOpus() {
  let supported = false;
  if (typeof AudioDecoder !== "undefined") {
    try {
      supported = (await AudioDecoder.isConfigSupported({ codec: "opus", sampleRate: 48000, numberOfChannels: 1 })).supported;
    } catch { supported = false; }
  }
  state.webCodecs = supported;
  const option = $("format").querySelector(`option[value="${OPUS}"]`);
  if (!supported) {
    option.disabled = true;
    option.textContent += " · not in this browser";
    if ($("format").value === OPUS) $("format").value = "f32";
  }
}

// ------------------------------------------------------------------ connection

// A token in the address (an older link) moves to session storage, out of the URL and history.
if (params.has("token")) {
  sessionStorage.setItem(TOKEN_KEY, params.get("token"));
  params.delete("token");
  history.replaceState(null, "", `${location.pathname}${params.toString() ? `?${params}` : ""}${location.hash}`);
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  return btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function subprotocols() {
  const t = token();
  return t ? ["vox-ws", `vox-ws.bearer.${base64url(t)}`] : [];
}

function authHeaders() {
  const t = token();
  return t ? { Authorization: `Bearer ${t}` } : {};
}

function askForToken(refused) {
  state.needsToken = true;
  $("token-form").hidden = false;
  $("token").focus();
  setConnection("closed", refused ? "token refused" : "needs a token");
  say(refused ? "The server refused that token; type another." : "This server needs an access token.", "error");
}

function useToken(event) {
  event.preventDefault();
  const typed = $("token").value.trim();
  if (!typed) return;
  sessionStorage.setItem(TOKEN_KEY, typed);
  $("token").value = "";
  $("token-form").hidden = true;
  state.needsToken = false;
  say("");
  reconnectDelay = 500;
  connect();
}

function streamUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/v1/stream`;
}

function connect() {
  setConnection("connecting", "connecting…");
  ws = new WebSocket(streamUrl(), subprotocols());
  ws.binaryType = "arraybuffer";
  ws.onopen = () => { reconnectDelay = 500; };
  ws.onmessage = (event) => {
    if (!(event.data instanceof ArrayBuffer)) return;
    let msg;
    try { msg = decode(new Uint8Array(event.data)); } catch (err) { say(`Unreadable message from the server: ${err}`, "error"); return; }
    handle(msg);
  };
  ws.onclose = (event) => {
    state.connected = false;
    state.ready = false;
    $("speak").disabled = true;
    if (state.stream && !state.stream.ended) endLocally("the connection closed");
    if (event.code === 4001) {            // trying again with the same token will not help
      askForToken(Boolean(token()));
      return;
    }
    setConnection("closed", `disconnected (${closeReason(event.code)}); retrying…`);
    setTimeout(connect, reconnectDelay);
    reconnectDelay = Math.min(reconnectDelay * 2, 5000);
  };
}

function send(message) {
  ws.send(encode(message));
}

function handle(msg) {
  switch (msg.type) {
    case "hello": return onHello(msg);
    case "start": return onStart(msg);
    case "chunk": return onChunk(msg);
    case "end": return onEnd(msg);
    case "error": return onError(msg);
    case "voice": return onVoice(msg);
    case "voice_delete": return onVoiceDeleted(msg);
    case "words": return onWords(msg);
    case "segment": return onSegment(msg);
    default: return undefined;
  }
}

function onHello(hello) {
  state.hello = hello;
  state.connected = true;
  const ready = hello.status === "ready";
  state.ready = ready;
  setConnection(ready ? "open" : "connecting", ready ? `connected · ${hello.engine}` : `model ${hello.status}…`);
  $("server-info").textContent = `${hello.server} · engine ${hello.engine} · ${hello.model} · ${hello.sample_rate} Hz`;
  showVoices(hello.voices.map((id) => ({ id, name: id, kind: "builtin" })));   // at once; then the listing
  loadVoices();
  const features = hello.features || [];
  const follows = features.includes("instructions");
  $("instructions").disabled = !follows;
  $("instructions-note").textContent = follows ? "voice design" : `${hello.engine} does not follow them`;
  $("speed").disabled = !features.includes("speed");
  $("ssml").disabled = !features.includes("ssml") || $("llm").checked;
  $("llm").disabled = !features.includes("input_streaming");
  const canClone = features.includes("voice_cloning");
  $("clone").classList.toggle("disabled", !canClone);
  $("record").disabled = !canClone;
  $("clone-file").disabled = !canClone;
  if (!canClone) $("clone-note").textContent = `The ${hello.engine} engine cannot clone voices; VoxCPM2 can.`;
  $("speak").disabled = !ready;
  if (!ready) {
    say("The model is loading; this page will connect again when it is ready.");
    setTimeout(() => ws.close(), 1500);
  }
}

// The voices the server lists for this page's owner, its own clones among them (so a voice
// cloned before a reload is still there); `choose`: the voice to select once listed. Where the
// listing cannot be had, the menu keeps `hello`'s voices.
async function loadVoices(choose = null) {
  try {
    const reply = await fetch("/v1/audio/voices", { headers: authHeaders() });
    if (reply.ok) showVoices((await reply.json()).voices, choose);
  } catch {
    // the menu stays as it is
  }
}

// The menu: the default, the page owner's own voices, the server's, then its aliases (OpenAI's
// names, the aliases file's), each named as itself and saying what it stands for (voices.mjs).
// The owner's own voices are also listed under "Clone my voice", each with a Delete button.
function showVoices(voices, choose = null) {
  state.voices = voices;
  const select = $("voice");
  const current = choose ?? select.value;
  select.replaceChildren(new Option("default voice", ""));
  for (const [label, members] of voiceGroups(state.voices)) {
    const group = document.createElement("optgroup");
    group.label = label;
    for (const v of members) {
      const option = new Option(voiceLabel(v), v.id);
      if (v.instructions) option.title = v.instructions;      // a designed voice: its words
      group.append(option);
    }
    select.append(group);
  }
  if (choose && ![...select.options].some((o) => o.value === choose)) select.add(new Option(choose, choose));
  if ([...select.options].some((o) => o.value === current)) select.value = current;
  showOwnVoices(state.voices.filter((v) => v.kind === "uploaded"));
}

function showOwnVoices(own) {
  const list = $("my-voices");
  const now = Date.now() / 1000;
  list.replaceChildren(...own.map((v) => {
    const item = document.createElement("li");
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = v.name;
    const note = document.createElement("span");
    note.className = "note";
    note.textContent = ownVoiceNote(v, now);
    const remove = document.createElement("button");
    remove.textContent = "Delete";
    remove.dataset.voice = v.voice_id;
    remove.title = `Delete ${v.name} from the server`;
    remove.addEventListener("click", () => deleteVoice(v));
    item.append(name, note, remove);
    return item;
  }));
  $("my-voices-box").hidden = own.length === 0;
}

// ------------------------------------------------------------------ audio

// Must run synchronously inside the click handler: no await before the AudioContext exists.
function ensureAudio() {
  if (!ctx) {
    ctx = new AudioContext({ latencyHint: "interactive" });
    state.contextRate = ctx.sampleRate;   // browsers may not honour a requested rate: read it back
    playerReady = ctx.audioWorklet.addModule("player-worklet.js").then(() => {
      player = new AudioWorkletNode(ctx, "vox-player", {
        numberOfInputs: 0, outputChannelCount: [1],
        processorOptions: { jitterMs: 80, initialSeconds: 30 },
      });
      player.port.onmessage = (event) => onPlayerMessage(event.data);
      player.connect(ctx.destination);
    });
  }
  if (ctx.state !== "running") ctx.resume();
  return playerReady;
}

function onPlayerMessage(m) {
  if (m.type === "stats") {
    Object.assign(state.player, {
      played: m.played, underruns: m.underruns, sourceLate: m.sourceLate, buffered: m.buffered,
      sumSquares: m.sumSquares,
      peak: m.peak, playing: m.playing, blockRms: m.blockRms,
    });
    envelope.push(m.windowPeak);
    if (envelope.length > ENVELOPE_POINTS) envelope.shift();
    drawEnvelope();
    $("level-bar").style.width = `${Math.min(100, m.windowPeak * 140).toFixed(1)}%`;
  } else if (m.type === "drained") {
    state.player.played = m.played;
    if (state.stream && state.stream.ended) state.drained = true;
  }
}

function pcmFromBytes(bytes, format) {
  const copy = bytes.slice();          // own, aligned buffer
  if (format === "f32") {
    if (LITTLE_ENDIAN) return new Float32Array(copy.buffer);
    const view = new DataView(copy.buffer);
    return Float32Array.from({ length: copy.length / 4 }, (_, i) => view.getFloat32(i * 4, true));
  }
  const view = new DataView(copy.buffer);
  const out = new Float32Array(copy.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(i * 2, true) / 32768;
  return out;
}

// `arrivedAt`: when the audio reached the page, on the audio clock (see player-worklet.js).
function toPlayer(samples, arrivedAt) {
  if (samples.length) player.port.postMessage({ type: "samples", samples, arrivedAt }, [samples.buffer]);
}

// ------------------------------------------------------------------ streams

async function speak() {
  const audioReady = ensureAudio();       // inside the click, before any await
  const text = $("text").value.trim();
  if (!text) { say("Type something to say first.", "error"); return; }
  if (state.stream && !state.stream.ended) stop();
  await audioReady;
  const choice = $("rate").value;
  const format = $("format").value;
  let rate = null;
  if (choice === "auto") rate = Math.round(Math.min(48000, Math.max(8000, ctx.sampleRate)));
  else if (choice !== "native") rate = Number(choice);
  // Opus takes five rates; browsers decode it at 48 kHz whatever it was encoded at.
  if (format === OPUS && !OPUS_RATES.includes(rate)) rate = 48000;
  const features = state.hello.features || [];
  const llm = $("llm").checked;
  const id = `d${++streamCounter}`;
  const message = { type: "start", id, format, segment_events: true };
  if (llm) message.stream_input = true;
  else message.text = text;
  if (rate) message.sample_rate = rate;
  if ($("voice").value) message.voice = $("voice").value;
  const speed = Number($("speed").value);
  if (speed !== 1 && !$("speed").disabled) message.speed = speed;
  const instructions = $("instructions").value.trim();
  if (instructions && !$("instructions").disabled) message.instructions = instructions;
  if (!llm && features.includes("ssml")) message.markup = $("ssml").checked ? "ssml" : "none";
  const byWords = features.includes("word_timestamps");
  if (byWords && $("captions-on").checked) message.word_timestamps = true;
  state.stream = { id, rate: rate || state.hello.sample_rate, format: message.format, sentAt: performance.now(),
                   firstAudioAt: null, chunks: 0, samples: 0, bytes: 0, ended: false, cancelled: false,
                   timestamp: 0, decoded: 0, preSkip: 0, arrivals: new Map(), llm, feed: null,
                   words: { sent: 0, total: 0 },
                   recording: { rate: null, chunks: [], frames: 0, truncated: false },
                   opus: { head: null, packets: [], durations: [], us: 0 }, request: message };
  state.lastEnd = null;
  state.lastError = null;
  state.drained = false;
  startCaptions($("captions-on").checked ? new CaptionTrack(byWords) : null);
  setDownloads(false);
  player.port.postMessage({ type: "begin" });
  send(message);
  // The figures count from the first word: the time an agent's user waits once its LLM speaks.
  if (llm) feedLikeAnLlm(state.stream, text);
  $("stat-ttfa-label").textContent = llm ? "first audio, 1st word" : "first audio";
  $("stop").disabled = false;
  say(llm ? "Streaming the text in word by word…" : "Speaking…");
}

// The text as an LLM would send it: a word at a time, then the end of the input.
function feedLikeAnLlm(s, text) {
  const words = text.match(/\S+\s*/g) || [];
  s.words.total = words.length;
  const next = () => {
    s.feed = null;
    if (s.ended || s.cancelled || ws.readyState !== WebSocket.OPEN) return;
    if (s.words.sent < words.length) {
      send({ type: "chunk", id: s.id, text: words[s.words.sent] });
      s.words.sent += 1;
      s.feed = setTimeout(next, WORD_INTERVAL_MS);
    } else {
      send({ type: "end", id: s.id });
    }
  };
  next();
}

function stopFeeding(s) {
  if (s.feed !== null) clearTimeout(s.feed);
  s.feed = null;
}

// Audio kept for the download, as it came (before any resampling for the speakers).
function record(s, pcm, rate) {
  const r = s.recording;
  r.rate = rate;
  if (r.frames >= MAX_RECORD_S * rate) { r.truncated = true; return; }
  r.chunks.push(pcm.slice());
  r.frames += pcm.length;
}

function onStart(msg) {
  const s = state.stream;
  if (!s || msg.id !== s.id) return;
  s.rate = msg.sample_rate;
  s.format = msg.format;
  s.ignored = msg.ignored_options || [];
  closeDecoder();
  if (s.format === OPUS) {
    resampler = null;                         // made for the rate the decoder outputs
    decoder = openDecoder(s);
  } else {
    resampler = s.rate === ctx.sampleRate ? null : new Resampler(s.rate, ctx.sampleRate);
  }
  if (msg.queued) say(`Waiting for a free slot (position ${msg.queued})…`);
}

function onChunk(msg) {
  const s = state.stream;
  // Audio of a stopped stream is never played: chunks already on the wire when Stop was
  // clicked still arrive, before the server's "end".
  if (!s || msg.id !== s.id || s.ended || s.cancelled) return;
  if (s.firstAudioAt === null) s.firstAudioAt = performance.now();
  s.chunks += 1;
  if (s.format === OPUS) {
    decodeOpus(s, msg);
    return;
  }
  const pcm = pcmFromBytes(msg.audio, s.format);
  s.samples += pcm.length;
  s.bytes += msg.audio.length;
  record(s, pcm, s.rate);
  toPlayer(resampler ? resampler.process(pcm) : pcm, ctx.currentTime);
}

// ------------------------------------------------------------------ Opus through WebCodecs

function openDecoder(s) {
  const d = new AudioDecoder({
    output: (data) => {
      if (s.cancelled) { data.close(); return; }
      const pcm = new Float32Array(data.numberOfFrames);
      data.copyTo(pcm, { planeIndex: 0, format: "f32-planar" });
      if (!resampler && data.sampleRate !== ctx.sampleRate) resampler = new Resampler(data.sampleRate, ctx.sampleRate);
      s.decoded += pcm.length / data.sampleRate;
      record(s, pcm, data.sampleRate);
      const arrivedAt = s.arrivals.get(data.timestamp) ?? ctx.currentTime;
      s.arrivals.delete(data.timestamp);
      data.close();
      toPlayer(resampler ? resampler.process(pcm) : pcm, arrivedAt);
    },
    error: (err) => say(`The Opus decoder failed: ${err.message}`, "error"),
  });
  return d;
}

function decodeOpus(s, msg) {
  if (msg.description) {
    // The first chunk carries the OpusHead: channel layout and pre-skip for the decoder.
    decoder.configure({ codec: "opus", sampleRate: s.rate, numberOfChannels: 1, description: msg.description });
    s.preSkip = msg.pre_skip;
    s.opus.head = msg.description.slice();
  }
  let micros = 0;
  msg.packets.forEach((packet, i) => {
    const duration = msg.durations_us[i];
    if (s.opus.us < MAX_RECORD_S * 1e6) {
      s.opus.packets.push(packet.slice());
      s.opus.durations.push(duration);
      s.opus.us += duration;
    }
    s.arrivals.set(s.timestamp, ctx.currentTime);
    decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: s.timestamp, duration, data: packet }));
    s.timestamp += duration;
    micros += duration;
    s.bytes += packet.length;
  });
  s.samples += Math.round((micros * s.rate) / 1e6);
}

function closeDecoder() {
  if (decoder && decoder.state !== "closed") decoder.close();
  decoder = null;
}

function onEnd(msg) {
  const s = state.stream;
  if (!s || msg.id !== s.id) return;
  s.ended = true;
  stopFeeding(s);
  state.lastEnd = msg;
  // The player hears "end" only after the last samples: Opus packets may still be decoding.
  const decoded = s.format === OPUS && decoder && msg.reason !== "cancelled" ? decoder.flush() : Promise.resolve();
  decoded.catch(() => {}).then(() => {
    if (resampler && msg.reason !== "cancelled") toPlayer(resampler.flush(), ctx.currentTime);
    player.port.postMessage({ type: "end" });
    setDownloads(true);
  });
  $("stop").disabled = true;
  const words = { done: "Done.", cancelled: "Stopped.", max_len: "Stopped at the length limit." }[msg.reason] || msg.reason;
  say(`${words} ${msg.audio_s.toFixed(2)} s of audio, first audio after ${msg.ttfa_ms ?? "–"} ms (server).`,
      msg.reason === "done" ? "ok" : "");
}

function onError(msg) {
  state.lastError = msg;
  const words = ERROR_WORDS[msg.code] || "Something went wrong";
  say(`${words.replace(/\.$/, "")}. (${msg.code}: ${msg.message})`, "error");
  if (state.stream && msg.id === state.stream.id) endLocally(msg.code);
  if (msg.id && msg.id.startsWith("voice-")) $("clone-status").textContent = msg.message;
}

function endLocally(reason) {
  state.stream.ended = true;
  stopFeeding(state.stream);
  setDownloads(true);
  state.lastEnd = { id: state.stream.id, reason, local: true };
  player.port.postMessage({ type: "end" });
  $("stop").disabled = true;
}

function stop() {
  if (!state.stream || state.stream.ended) return;
  state.stream.cancelled = true;                   // decoded audio still in flight is dropped
  stopFeeding(state.stream);                       // no more words go in
  closeDecoder();                                  // drops what it was still decoding
  player.port.postMessage({ type: "clear" });      // silence what is queued here at once
  send({ type: "cancel", id: state.stream.id });   // and free the server's slot
  say("Stopping…");
}

// ------------------------------------------------------------------ clone my voice

let recording = null;

async function toggleRecord() {
  const audioReady = ensureAudio();
  if (recording) {
    recording.stop();
    return;
  }
  await audioReady;
  try {
    const mic = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1, echoCancellation: true } });
    await ctx.audioWorklet.addModule("recorder-worklet.js");
    const source = ctx.createMediaStreamSource(mic);
    const node = new AudioWorkletNode(ctx, "vox-recorder");
    const parts = [];
    node.port.onmessage = (event) => parts.push(event.data);
    source.connect(node);
    $("record").textContent = "■ Stop recording";
    $("clone-status").textContent = "Recording…";
    recording = {
      stop() {
        source.disconnect();
        node.disconnect();
        mic.getTracks().forEach((t) => t.stop());
        const length = parts.reduce((n, p) => n + p.length, 0);
        const samples = new Float32Array(length);
        let offset = 0;
        for (const p of parts) { samples.set(p, offset); offset += p.length; }
        pendingVoiceAudio = encodeWav(samples, ctx.sampleRate);
        recording = null;
        $("record").textContent = "● Record";
        $("clone-status").textContent = `Recorded ${(length / ctx.sampleRate).toFixed(1)} s.`;
        $("clone-upload").disabled = false;
      },
    };
  } catch (err) {
    $("clone-status").textContent = `No microphone: ${err.message}`;
  }
}

async function pickFile(event) {
  const file = event.target.files[0];
  if (!file) return;
  const bytes = new Uint8Array(await file.arrayBuffer());
  const magic = String.fromCharCode(...bytes.slice(0, 4));
  if (magic === "RIFF" || magic === "fLaC") {
    pendingVoiceAudio = bytes;
  } else {
    // Other formats: let the browser decode them, then send WAV.
    await ensureAudio();
    const audio = await ctx.decodeAudioData(bytes.buffer.slice(0));
    pendingVoiceAudio = encodeWav(audio.getChannelData(0), audio.sampleRate);
  }
  $("clone-status").textContent = `${file.name} ready.`;
  $("clone-upload").disabled = false;
}

function uploadVoice() {
  if (!pendingVoiceAudio) return;
  const message = { type: "voice", id: `voice-${++requestCounter}`, audio: pendingVoiceAudio };
  const transcript = $("clone-transcript").value.trim();
  if (transcript) message.transcript = transcript;
  const name = $("clone-name").value.trim();
  if (name) message.name = name;
  send(message);
  $("clone-status").textContent = "Building the voice…";
}

// Deleted from the server (protocol v1's `voice_delete`), for every door: the answer relists.
function deleteVoice(v) {
  if (!state.connected) { $("clone-status").textContent = "Not connected: try again in a moment."; return; }
  send({ type: "voice_delete", id: `voice-delete-${++requestCounter}`, voice: v.voice_id });
  $("clone-status").textContent = `Deleting ${v.name}…`;
}

async function onVoiceDeleted(msg) {
  state.deleted.push({ voice: msg.voice, deleted: msg.deleted });
  const v = state.voices.find((voice) => voice.voice_id === msg.voice);
  await loadVoices();
  const name = v ? v.name : msg.voice;
  $("clone-status").textContent = msg.deleted ? `Deleted ${name}.` : `${name} was no longer on the server.`;
}

async function onVoice(msg) {
  // Listed by the server from now on: a reload, or another tab with the same token, finds it.
  await loadVoices(msg.name || msg.voice);
  $("clone-status").textContent = `Your voice is selected (${msg.audio_s.toFixed(1)} s, ${msg.mode}).`;
}

// ------------------------------------------------------------------ captions

function startCaptions(track) {
  state.captions = track;
  state.captionIndex = -1;
  state.captionsDone = false;
  const box = $("captions");
  box.replaceChildren();
  box.hidden = !track;
}

function showCaptions(items) {
  const box = $("captions");
  for (const item of items) {
    const span = document.createElement("span");
    span.textContent = item.text;
    span.dataset.start = item.start_s.toFixed(3);
    box.append(span, " ");
  }
}

function onWords(msg) {
  if (state.captions && state.stream && msg.id === state.stream.id) showCaptions(state.captions.addWords(msg.words));
}

function onSegment(msg) {
  if (state.captions && state.stream && msg.id === state.stream.id) showCaptions(state.captions.addSegment(msg));
}

// Lights the item being heard, on the player's own clock (what has been played of the stream).
function followCaptions() {
  if (!state.captions || !ctx) return;
  const heard = state.drained && state.stream && state.stream.ended ? Infinity : state.player.played / ctx.sampleRate;
  const index = state.captions.indexAt(heard);
  const done = heard === Infinity;                  // all played: every item heard, none lit
  if (index === state.captionIndex && done === state.captionsDone) return;
  const spans = $("captions").children;
  for (let i = Math.max(0, Math.min(index, state.captionIndex)); i <= Math.max(index, state.captionIndex); i++) {
    if (!spans[i]) continue;
    spans[i].classList.toggle("spoken", i <= index);
    spans[i].classList.toggle("now", i === index && !done);
  }
  state.captionIndex = index;
  state.captionsDone = done;
  const lit = spans[index];
  if (lit) {
    const box = $("captions");
    box.scrollTop = Math.max(0, lit.offsetTop - box.offsetTop - box.clientHeight / 2);
  }
}

// ------------------------------------------------------------------ downloads

function setDownloads(ready) {
  const s = state.stream;
  $("download-wav").disabled = !(ready && s && s.recording.frames > 0);
  $("download-opus").disabled = !(ready && s && s.opus.head && s.opus.packets.length > 0);
}

function offer(blob, name) {
  const url = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
  state.downloads.push({ name, bytes: blob.size });
}

function downloadWav() {
  const r = state.stream.recording;
  const samples = new Float32Array(r.frames);
  let at = 0;
  for (const chunk of r.chunks) { samples.set(chunk, at); at += chunk.length; }
  offer(new Blob([encodeWav(samples, r.rate)], { type: "audio/wav" }), `vox-ws-${state.stream.id}.wav`);
  if (r.truncated) say(`The download holds the first ${MAX_RECORD_S / 60} minutes.`);
}

function downloadOpus() {
  const o = state.stream.opus;
  offer(oggOpus(o.head, o.packets, o.durations), `vox-ws-${state.stream.id}.opus`);
}

// ------------------------------------------------------------------ display

function say(text, kind = "") {
  const el = $("message");
  el.textContent = text;
  el.className = `message ${kind}`;
}

function setConnection(kind, text) {
  $("connection").dataset.state = kind;
  $("connection-text").textContent = text;
}

// The last few seconds of what was played: one bar per ~21 ms (8 render quanta), scrolling left.
const ENVELOPE_POINTS = 160;
const envelope = [];

function drawEnvelope() {
  const canvas = $("scope");
  const g = canvas.getContext("2d");
  const { width, height } = canvas;
  g.fillStyle = "#0d1322";
  g.fillRect(0, 0, width, height);
  const scale = 1 / Math.max(0.25, ...envelope);      // speech rarely peaks at full scale
  const barWidth = width / ENVELOPE_POINTS;
  const offset = ENVELOPE_POINTS - envelope.length;
  const gradient = g.createLinearGradient(0, 0, width, 0);
  gradient.addColorStop(0, "#2f4c8f");
  gradient.addColorStop(1, "#5b8cff");
  g.fillStyle = gradient;
  for (let i = 0; i < envelope.length; i++) {
    const h = Math.max(1, envelope[i] * scale * (height / 2 - 6));
    g.fillRect((offset + i) * barWidth + 1, height / 2 - h, Math.max(1, barWidth - 2), 2 * h);
  }
  g.fillStyle = "#24304a";
  g.fillRect(0, height / 2, width, 1);
}

function refreshStats() {
  const s = state.stream;
  const fmt = (v, unit, digits = 2) => (v === null || v === undefined ? "–" : `${v.toFixed(digits)} ${unit}`);
  if (s) {
    const received = s.samples / s.rate;
    const elapsed = ((s.ended && state.lastEnd && !state.lastEnd.local ? (s.firstAudioAt ?? performance.now()) : performance.now()) - s.sentAt) / 1000;
    $("stat-ttfa").textContent = s.firstAudioAt === null ? "–" : `${Math.round(s.firstAudioAt - s.sentAt)} ms`;
    $("stat-sent").textContent = s.llm ? `${s.words.sent} of ${s.words.total} words` : "all at once";
    $("stat-chunks").textContent = String(s.chunks);
    $("stat-audio").textContent = fmt(received, "s");
    $("stat-bytes").textContent = s.bytes >= 1e6 ? `${(s.bytes / 1e6).toFixed(2)} MB` : `${(s.bytes / 1e3).toFixed(1)} kB`;
    $("stat-bitrate").textContent = received > 0 ? `${((s.bytes * 8) / received / 1000).toFixed(0)} kbit/s` : "–";
    $("stat-rtf").textContent = state.lastEnd && state.lastEnd.rtf ? state.lastEnd.rtf.toFixed(3)
      : received > 0 ? (elapsed / received).toFixed(3) : "–";
    const reason = state.lastEnd ? state.lastEnd.reason : "ended";
    $("stat-state").textContent = !s.ended ? (s.firstAudioAt === null ? "waiting" : "playing")
      : state.drained || reason !== "done" ? reason : "playing · generated";
  }
  if (ctx) {
    $("stat-played").textContent = fmt(state.player.played / ctx.sampleRate, "s");
    $("stat-buffer").textContent = `${Math.round((state.player.buffered / ctx.sampleRate) * 1000)} ms`;
    const late = state.player.sourceLate;
    $("stat-underruns").textContent = `${state.player.underruns}${late ? ` (${late} waiting for the server)` : ""}`;
  }
  followCaptions();
  requestAnimationFrame(refreshStats);
}

$("speak").addEventListener("click", speak);
$("stop").addEventListener("click", stop);
$("record").addEventListener("click", toggleRecord);
$("clone-file").addEventListener("change", pickFile);
$("clone-upload").addEventListener("click", uploadVoice);
$("download-wav").addEventListener("click", downloadWav);
$("download-opus").addEventListener("click", downloadOpus);
$("token-form").addEventListener("submit", useToken);
$("speed").addEventListener("input", () => { $("speed-value").textContent = `${Number($("speed").value).toFixed(2)}×`; });
$("llm").addEventListener("change", () => {
  // SSML is read from a whole text: a text streamed in is plain.
  if ($("llm").checked) $("ssml").checked = false;
  $("ssml").disabled = $("llm").checked || !(state.hello && (state.hello.features || []).includes("ssml"));
});
$("text").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) speak(); });
drawEnvelope();
requestAnimationFrame(refreshStats);
detectWebCodecsOpus();
connect();
