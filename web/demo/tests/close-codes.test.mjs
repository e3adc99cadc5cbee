// node --test web/demo/tests/
import assert from "node:assert/strict";
import test from "node:test";

import { closeReason } from "../close-codes.mjs";

test("a draining server's close (1012) reads as a restart, a going-away one (1001) does not", () => {
  assert.equal(closeReason(1012), "server restarting");
  assert.equal(closeReason(1001), "the server went away");
});

test("every close code the server sends has words, others their number", () => {
  for (const code of [1000, 1008, 1011, 1013, 4000, 4001, 4029]) assert.doesNotMatch(closeReason(code), /^code /);
  assert.equal(closeReason(4999), "code 4999");
});
