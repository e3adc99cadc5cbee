// node --test web/demo/tests/
import assert from "node:assert/strict";
import test from "node:test";

import { ownVoiceNote, voiceGroups, voiceLabel } from "../voices.mjs";

test("an alias is named as itself and says what it stands for", () => {
  assert.equal(voiceLabel({ id: "alloy", name: "alloy", kind: "alias", voice: "joe" }), "alloy · alias of joe");
  assert.equal(voiceLabel({ id: "slow", name: "slow", kind: "alias", voice: "joe", speed: 0.8 }),
               "slow · alias of joe, 0.8× speed");
  assert.equal(voiceLabel({ id: "nova", name: "nova", kind: "alias", voice: null, instructions: "A young woman." }),
               "nova · designed voice");
  assert.equal(voiceLabel({ id: "quick", name: "quick", kind: "alias", voice: null, speed: 1.25 }),
               "quick · alias of the default voice, 1.25× speed");
});

test("built-in voices by their name, the visitor's own with how they were made", () => {
  assert.equal(voiceLabel({ id: "joe", name: "joe", kind: "builtin" }), "joe");
  assert.equal(voiceLabel({ id: "Kitchen", name: "Kitchen", kind: "uploaded", mode: "both" }), "Kitchen (both)");
});

test("the groups: the visitor's voices, others' public ones, the server's, then the aliases; none empty", () => {
  const voices = [{ id: "alloy", kind: "alias" }, { id: "joe", kind: "builtin" }, { id: "mine", kind: "uploaded" },
                  { id: "Narrator", kind: "public" }];
  assert.deepEqual(voiceGroups(voices).map(([label, members]) => [label, members.map((v) => v.id)]),
                   [["my voices", ["mine"]], ["shared voices", ["Narrator"]], ["voices", ["joe"]],
                    ["aliases", ["alloy"]]]);
  assert.deepEqual(voiceGroups([{ id: "joe", kind: "builtin" }]).map(([label]) => label), ["voices"]);
});

test("a voice that expires says when", () => {
  assert.equal(ownVoiceNote({ mode: "reference", expires_at: 1000 + 5 * 3600 }, 1000), "reference · expires in 5 h");
  assert.equal(ownVoiceNote({ mode: "both", expires_at: 1000 + 90 }, 1000), "both · expires in 2 min");
  assert.equal(ownVoiceNote({ mode: "both", expires_at: null }, 1000), "both");
});
