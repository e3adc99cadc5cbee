// node --test web/demo/tests/
// The player worklet run block by block on a clock of the test's own: what it plays, when it
// runs dry, and whose fault each underrun was (the source's, or the page's own delay).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import test from "node:test";
import vm from "node:vm";

const RATE = 48000;
const BLOCK = 128;

function loadPlayer() {
  const sent = [];
  const context = {
    sampleRate: RATE,
    currentTime: 0,
    AudioWorkletProcessor: class {
      constructor() {
        this.port = { postMessage: (m) => sent.push(m), onmessage: null };
      }
    },
    registerProcessor: (name, cls) => { context.Processor = cls; },
    Float32Array, Math,
  };
  vm.createContext(context);
  vm.runInContext(readFileSync(new URL("../player-worklet.js", import.meta.url), "utf8"), context);
  const node = new context.Processor({ processorOptions: { jitterMs: 10, initialSeconds: 1 } });
  const out = [new Float32Array(BLOCK)];
  return {
    node,
    sent,
    send: (msg) => node.port.onmessage({ data: msg }),
    now: () => context.currentTime,
    // One render quantum, then the clock moves on by its length.
    block: () => {
      node.process([], [out]);
      context.currentTime += BLOCK / RATE;
      return out[0];
    },
    stats: () => { node.report(false); return sent.at(-1); },
  };
}

const tone = (frames) => Float32Array.from({ length: frames }, (_, i) => 0.5 * Math.sin(i / 10));

test("audio that came in time plays whole, in order, with no underrun", () => {
  const p = loadPlayer();
  p.send({ type: "begin" });
  p.send({ type: "samples", samples: tone(BLOCK * 20), arrivedAt: p.now() });
  for (let i = 0; i < 10; i++) p.block();
  p.send({ type: "samples", samples: tone(BLOCK * 20), arrivedAt: p.now() });
  p.send({ type: "end" });
  for (let i = 0; i < 40; i++) p.block();
  const s = p.stats();
  assert.equal(s.played, BLOCK * 40);
  assert.equal(s.underruns, 0);
  assert.equal(s.sourceLate, 0);
});

test("running dry before the next audio arrives is an underrun the source caused", () => {
  const p = loadPlayer();
  p.send({ type: "begin" });
  p.send({ type: "samples", samples: tone(BLOCK * 4), arrivedAt: p.now() });
  for (let i = 0; i < 8; i++) p.block();              // plays 4 blocks, then runs dry
  p.send({ type: "samples", samples: tone(BLOCK * 4), arrivedAt: p.now() });   // arrives late
  p.send({ type: "end" });
  for (let i = 0; i < 8; i++) p.block();
  const s = p.stats();
  assert.equal(s.underruns, 1);
  assert.equal(s.sourceLate, 1);
  assert.equal(s.played, BLOCK * 8);
});

test("running dry while the page held audio that had arrived is the page's underrun", () => {
  const p = loadPlayer();
  p.send({ type: "begin" });
  const arrived = p.now();                             // the chunk is at the page already...
  p.send({ type: "samples", samples: tone(BLOCK * 4), arrivedAt: arrived });
  for (let i = 0; i < 8; i++) p.block();
  // ... but its second half reaches the player only after the ring ran dry.
  p.send({ type: "samples", samples: tone(BLOCK * 4), arrivedAt: arrived });
  p.send({ type: "end" });
  for (let i = 0; i < 8; i++) p.block();
  const s = p.stats();
  assert.equal(s.underruns, 1);
  assert.equal(s.sourceLate, 0);
});

test("a stream whose end comes after the ring ran dry was late too; what is left plays out", () => {
  const p = loadPlayer();
  p.send({ type: "begin" });
  p.send({ type: "samples", samples: tone(BLOCK * 4), arrivedAt: p.now() });
  for (let i = 0; i < 6; i++) p.block();               // 4 blocks played, then dry
  assert.equal(p.sent.filter((m) => m.type === "drained").length, 0);
  p.send({ type: "end" });                             // nothing more came: drained at once
  assert.equal(p.sent.filter((m) => m.type === "drained").length, 1);
  for (let i = 0; i < 4; i++) p.block();
  const s = p.stats();
  assert.deepEqual([s.underruns, s.sourceLate, s.played], [1, 1, BLOCK * 4]);
  assert.equal(p.sent.filter((m) => m.type === "drained").length, 1);
});
