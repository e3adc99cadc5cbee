// The voice picker's groups and words, from the server's list (`GET /v1/audio/voices`): each
// voice {id, name, kind: builtin | alias | uploaded | public, ...}. An alias is named as itself and says
// what it stands for (`alloy · alias of joe`, `slow · alias of joe, 0.8× speed`, `nova ·
// designed voice`), as a visitor otherwise cannot tell OpenAI's names or the aliases file's
// from the voices they stand for.

// In the menu's order: what the visitor registered first, then the voices others made public,
// the server's voices, and the names that stand for them.
export const GROUPS = [["uploaded", "my voices"], ["public", "shared voices"], ["builtin", "voices"],
  ["alias", "aliases"]];

export function voiceLabel(v) {
  if (v.kind === "uploaded") return v.mode ? `${v.name} (${v.mode})` : v.name;
  if (v.kind !== "alias") return v.name;
  // An alias without a voice stands for a voice designed from its words (VoxCPM2), or else for
  // the engine's default voice.
  const of = v.voice ? `alias of ${v.voice}` : v.instructions ? "designed voice" : "alias of the default voice";
  const speed = v.speed && v.speed !== 1 ? `, ${v.speed}× speed` : "";
  return `${v.name} · ${of}${speed}`;
}

// [label, voices] for each group that has voices, in GROUPS' order.
export function voiceGroups(voices) {
  return GROUPS.map(([kind, label]) => [label, voices.filter((v) => v.kind === kind)])
    .filter(([, members]) => members.length > 0);
}

// What the visitor's list of its voices says of one: how it was registered and, for a voice
// that expires (a visitor without a token), until when (`now`, `expires_at`: Unix seconds).
export function ownVoiceNote(v, now) {
  const parts = [v.mode].filter(Boolean);
  if (v.expires_at) {
    const hours = Math.max(0, (v.expires_at - now) / 3600);
    parts.push(hours >= 1 ? `expires in ${Math.round(hours)} h` : `expires in ${Math.ceil(hours * 60)} min`);
  }
  return parts.join(" · ");
}
