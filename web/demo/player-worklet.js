// The playback end of the demo: a ring buffer read by the audio clock.
//
// Samples arrive (already at the AudioContext's rate) through the port and are played in order:
// never dropped, never repeated. Playback of a stream starts once `startFrames` are buffered
// (a small jitter buffer); if the buffer runs dry before the stream has ended, that is an
// underrun: silence is played and playback resumes when `startFrames` are buffered again.
// Each batch of samples says when its audio reached the page (`arrivedAt`, the context's clock):
// an underrun ended by audio that arrived after the ring ran dry was the source's (the server
// or the network fell behind real time, `sourceLate`); one ended by audio that had already
// arrived was the page's own delay.
// The ring grows instead of overwriting when a fast server gets far ahead of the player.

class PlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const seconds = (options.processorOptions && options.processorOptions.initialSeconds) || 30;
    this.ring = new Float32Array(Math.ceil(sampleRate * seconds));
    this.read = 0;           // total frames read (monotonic)
    this.written = 0;        // total frames written (monotonic)
    this.startFrames = Math.round(sampleRate * ((options.processorOptions && options.processorOptions.jitterMs) || 80) / 1000);
    this.playing = false;    // inside a stream, past the jitter buffer
    this.streamOpen = false; // chunks may still come
    this.started = false;    // this stream has started playing at least once
    this.underruns = 0;
    this.sourceLate = 0;     // underruns the source caused (see above)
    this.dryAt = null;       // when the ring last ran dry, until audio comes again
    this.played = 0;         // frames of stream audio played (silence excluded)
    this.sumSquares = 0;
    this.peak = 0;
    this.blocks = 0;
    this.windowPeak = 0;     // peak since the last report, for the page's level display
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(msg) {
    if (msg.type === "begin") {
      this.streamOpen = true;
      this.playing = false;
      this.started = false;
      this.underruns = 0;
      this.sourceLate = 0;
      this.dryAt = null;
      this.played = 0;
      this.sumSquares = 0;
      this.peak = 0;
    } else if (msg.type === "samples") {
      if (this.dryAt !== null && msg.samples.length) {
        if (msg.arrivedAt >= this.dryAt) this.sourceLate += 1;
        this.dryAt = null;
      }
      this.write(msg.samples);
    } else if (msg.type === "end") {
      if (this.dryAt !== null) this.sourceLate += 1;   // the stream's end came after the ring ran dry
      this.dryAt = null;
      this.streamOpen = false;     // what is buffered plays out; running dry now is no underrun
      // Already played out (the end came after the last samples had played): drained now.
      if (!this.playing && this.written === this.read) this.port.postMessage({ type: "drained", played: this.played });
    } else if (msg.type === "clear") {
      this.read = this.written;    // barge-in: silence everything queued locally
      this.streamOpen = false;
      this.playing = false;
      this.report(true);
    }
  }

  write(samples) {
    const buffered = this.written - this.read;
    if (buffered + samples.length > this.ring.length) {
      // Grow (in the message handler, not in process()) rather than drop anything.
      let size = this.ring.length * 2;
      while (size < buffered + samples.length) size *= 2;
      const next = new Float32Array(size);
      for (let i = 0; i < buffered; i++) next[i] = this.ring[(this.read + i) % this.ring.length];
      this.ring = next;
      this.written = buffered;
      this.read = 0;
    }
    for (let i = 0; i < samples.length; i++) this.ring[(this.written + i) % this.ring.length] = samples[i];
    this.written += samples.length;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    const frames = out.length;
    let buffered = this.written - this.read;
    if (!this.playing && buffered >= this.startFrames) {
      this.playing = true;
      this.started = true;
    }
    if (!this.playing && !this.streamOpen && buffered > 0) this.playing = true;  // the tail of an ended stream
    let n = 0;
    if (this.playing) {
      n = Math.min(frames, buffered);
      for (let i = 0; i < n; i++) {
        const s = this.ring[(this.read + i) % this.ring.length];
        out[i] = s;
        this.sumSquares += s * s;
        const a = s < 0 ? -s : s;
        if (a > this.peak) this.peak = a;
        if (a > this.windowPeak) this.windowPeak = a;
      }
      this.read += n;
      this.played += n;
      if (n < frames) {
        this.playing = false;
        if (this.streamOpen && this.started) {
          this.underruns += 1;
          this.dryAt = currentTime + n / sampleRate;
        }
        if (!this.streamOpen) this.port.postMessage({ type: "drained", played: this.played });
      }
    }
    for (let i = n; i < frames; i++) out[i] = 0;
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (++this.blocks % 8 === 0) this.report(false, out);
    return true;
  }

  report(cleared, block) {
    let rms = 0;
    if (block) {
      let s = 0;
      for (let i = 0; i < block.length; i++) s += block[i] * block[i];
      rms = Math.sqrt(s / block.length);
    }
    this.port.postMessage({
      type: "stats",
      cleared: !!cleared,
      buffered: this.written - this.read,
      played: this.played,
      underruns: this.underruns,
      sourceLate: this.sourceLate,
      playing: this.playing,
      streamOpen: this.streamOpen,
      blockRms: rms,
      windowPeak: this.windowPeak,
      sumSquares: this.sumSquares,
      peak: this.peak,
    });
    this.windowPeak = 0;
  }
}

registerProcessor("vox-player", PlayerProcessor);
