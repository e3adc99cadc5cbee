// What a WebSocket close code from vox-ws means to the person at the page (docs/PROTOCOL.md,
// "Close codes"), and whether reconnecting at once makes sense.

const CLOSE_REASONS = {
  1000: "closed",
  1001: "the server went away",
  1008: "the server closed it: too many messages, or audio not read",
  1011: "the server's engine failed",
  1012: "server restarting",
  1013: "the server is busy",
  4000: "idle",
  4001: "not authorised: enter a token",
  4029: "too many connections from this address",
};

export function closeReason(code) {
  return CLOSE_REASONS[code] ?? `code ${code}`;
}
