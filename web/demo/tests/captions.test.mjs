// node --test web/demo/tests/
import assert from "node:assert/strict";
import test from "node:test";

import { CaptionTrack } from "../captions.mjs";

test("the word being heard is the last one started; a pause keeps the one before it lit", () => {
  const track = new CaptionTrack(true);
  track.addWords([{ word: "Hello,", start_s: 0.1, end_s: 0.5 }, { word: "world.", start_s: 0.8, end_s: 1.2 }]);
  assert.equal(track.indexAt(0), -1);
  assert.equal(track.indexAt(0.1), 0);
  assert.equal(track.indexAt(0.7), 0);
  assert.equal(track.indexAt(0.8), 1);
  assert.equal(track.indexAt(99), 1);
});

test("a track by words leaves segments out, a track by segments words", () => {
  const byWords = new CaptionTrack(true);
  assert.deepEqual(byWords.addSegment({ text: "Hi there.", start_s: 0, end_s: 1 }), []);
  const bySegments = new CaptionTrack(false);
  assert.deepEqual(bySegments.addWords([{ word: "Hi", start_s: 0, end_s: 0.3 }]), []);
  assert.deepEqual(bySegments.addSegment({ text: "Hi there.", start_s: 0, end_s: 1 }),
                   [{ text: "Hi there.", start_s: 0, end_s: 1 }]);
  assert.equal(bySegments.items.length, 1);
});
