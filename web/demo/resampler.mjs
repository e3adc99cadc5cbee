// Streaming band-limited resampler (Kaiser-windowed sinc), for when a stream's sample rate
// differs from the AudioContext's. Linear interpolation is audible; this is not. State (the
// input history and the fractional read position) carries across chunks, so chunk boundaries
// leave no seams: resampling a signal in pieces gives the same samples as in one go.

function besselI0(x) {
  let sum = 1, term = 1;
  for (let k = 1; k < 30; k++) {
    term *= (x / (2 * k)) * (x / (2 * k));
    sum += term;
  }
  return sum;
}

export class Resampler {
  constructor(inRate, outRate, halfTaps = 16, beta = 8.6) {
    this.inRate = inRate;
    this.outRate = outRate;
    this.step = inRate / outRate;             // input samples per output sample
    this.cutoff = Math.min(1, outRate / inRate) * 0.95;   // anti-alias when downsampling
    this.halfTaps = Math.ceil(halfTaps / Math.min(1, outRate / inRate));
    this.beta = beta;
    this.i0beta = besselI0(beta);
    this.history = new Float32Array(2 * this.halfTaps);   // zeros: silence before the stream
    this.pos = this.history.length;           // next output position: input sample 0
    // Polyphase table: the kernel for PHASES fractional offsets, computed once.
    this.phases = 512;
    const taps = 2 * this.halfTaps;
    this.table = new Float32Array((this.phases + 1) * taps);
    for (let p = 0; p <= this.phases; p++) {
      const frac = p / this.phases;
      for (let k = -this.halfTaps + 1; k <= this.halfTaps; k++) {
        this.table[p * taps + (k + this.halfTaps - 1)] = this.kernel(k - frac);
      }
    }
  }

  kernel(x) {
    const t = x / this.halfTaps;
    if (t <= -1 || t >= 1) return 0;
    const window = besselI0(this.beta * Math.sqrt(1 - t * t)) / this.i0beta;
    const arg = Math.PI * x * this.cutoff;
    const sinc = x === 0 ? 1 : Math.sin(arg) / arg;
    return this.cutoff * sinc * window;
  }

  // Resample one chunk; returns the output samples that are fully determined so far.
  process(input) {
    if (this.inRate === this.outRate) return input;
    const buf = new Float32Array(this.history.length + input.length);
    buf.set(this.history);
    buf.set(input, this.history.length);
    const out = [];
    const h = this.halfTaps;
    const taps = 2 * h;
    while (this.pos + h < buf.length) {
      const center = Math.floor(this.pos);
      const row = Math.round((this.pos - center) * this.phases) * taps;
      let acc = 0;
      for (let j = 0; j < taps; j++) {
        const idx = center - h + 1 + j;
        if (idx >= 0) acc += buf[idx] * this.table[row + j];
      }
      out.push(acc);
      this.pos += this.step;
    }
    // Keep what the next chunk's first outputs still need.
    const keepFrom = Math.max(0, Math.floor(this.pos) - h);
    this.history = buf.slice(keepFrom);
    this.pos -= keepFrom;
    return Float32Array.from(out);
  }

  // The tail held back for the filter, at the end of a stream.
  flush() {
    if (this.inRate === this.outRate) return new Float32Array(0);
    return this.process(new Float32Array(this.halfTaps + 1));
  }
}
