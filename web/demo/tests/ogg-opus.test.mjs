// node --test web/demo/tests/
import assert from "node:assert/strict";
import test from "node:test";

import { oggCrc, oggOpus } from "../ogg-opus.mjs";

test("Ogg's CRC is CRC-32 with polynomial 0x04c11db7, not reflected, no initial or final xor", () => {
  // The catalogued check value of that CRC (CRC-32/POSIX without its final xor).
  assert.equal(oggCrc(new TextEncoder().encode("123456789")), 0x89a1897f);
});

function pages(bytes) {
  const found = [];
  for (let at = 0; at < bytes.length;) {
    assert.equal(String.fromCharCode(...bytes.slice(at, at + 4)), "OggS");
    const view = new DataView(bytes.buffer, bytes.byteOffset + at);
    const segments = bytes[at + 26];
    const lacing = bytes.slice(at + 27, at + 27 + segments);
    const size = 27 + segments + lacing.reduce((n, v) => n + v, 0);
    const page = bytes.slice(at, at + size);
    const stored = view.getUint32(22, true);
    page.fill(0, 22, 26);
    found.push({ flags: bytes[at + 5], granule: Number(view.getBigInt64(6, true)), sequence: view.getUint32(18, true),
                 crcOk: oggCrc(page) === stored, lacing: [...lacing] });
    at += size;
  }
  return found;
}

test("packets become pages: head, tags, then whole packets with granules in 48 kHz samples", async () => {
  const head = new Uint8Array(19);
  head.set(new TextEncoder().encode("OpusHead"));
  head[8] = 1; head[9] = 1; new DataView(head.buffer).setUint16(10, 312, true);
  const packets = Array.from({ length: 120 }, (_, i) => new Uint8Array(i === 7 ? 300 : 60).fill(i));
  const file = new Uint8Array(await oggOpus(head, packets, packets.map(() => 20000)).arrayBuffer());
  const found = pages(file);
  assert.ok(found.every((p) => p.crcOk));
  assert.deepEqual(found.map((p) => p.sequence), [0, 1, 2, 3, 4]);
  assert.deepEqual(found.map((p) => p.flags), [0x02, 0, 0, 0, 0x04]);
  // 50 packets of 960 samples a page; the last holds 20.
  assert.deepEqual(found.map((p) => p.granule), [0, 0, 48000, 96000, 115200]);
  assert.deepEqual(found[2].lacing.slice(7, 9), [255, 45]);          // a 300-byte packet laced in two
});
