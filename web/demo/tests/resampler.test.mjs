// node --test web/demo/tests/
import assert from "node:assert/strict";
import test from "node:test";

import { Resampler } from "../resampler.mjs";
import { encodeWav } from "../wav.mjs";

function sine(rate, seconds, freq = 440, amp = 0.5) {
  const x = new Float32Array(Math.round(rate * seconds));
  for (let i = 0; i < x.length; i++) x[i] = amp * Math.sin((2 * Math.PI * freq * i) / rate);
  return x;
}

for (const [inRate, outRate] of [[22050, 48000], [48000, 44100], [16000, 48000], [48000, 16000], [24000, 24000]]) {
  test(`resamples ${inRate} -> ${outRate} Hz close to the ideal signal`, () => {
    const r = new Resampler(inRate, outRate);
    const out = [...r.process(sine(inRate, 1)), ...r.flush()];
    assert.ok(Math.abs(out.length - outRate) <= 4, `length ${out.length}`);
    let err = 0;
    for (let i = 200; i < outRate - 200; i++) {
      err = Math.max(err, Math.abs(out[i] - 0.5 * Math.sin((2 * Math.PI * 440 * i) / outRate)));
    }
    assert.ok(err < 1e-3, `max error ${err}`);
  });
}

test("chunk boundaries leave no seams", () => {
  const x = sine(22050, 1);
  const whole = new Resampler(22050, 48000);
  const a = [...whole.process(x), ...whole.flush()];
  const pieces = new Resampler(22050, 48000);
  const b = [];
  for (let i = 0; i < x.length; i += 7680) b.push(...pieces.process(x.subarray(i, i + 7680)));
  b.push(...pieces.flush());
  assert.equal(a.length, b.length);
  assert.deepEqual(a, b);
});

test("WAV header and samples", () => {
  const wav = encodeWav(new Float32Array([0, 0.5, -1]), 16000);
  const view = new DataView(wav.buffer);
  assert.equal(String.fromCharCode(...wav.slice(0, 4)), "RIFF");
  assert.equal(view.getUint32(24, true), 16000);
  assert.equal(view.getInt16(44 + 2, true), Math.round(0.5 * 32767));
  assert.equal(view.getInt16(44 + 4, true), -32767);
});
