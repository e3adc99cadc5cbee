// Opus packets (as protocol v1's `opus_packets` sends them) into an Ogg Opus file (RFC 7845),
// for the demo's download: the packets the server encoded, kept as they are, not re-encoded.
//
// Page 0 holds the OpusHead the server sent, page 1 an OpusTags, then audio pages of up to
// PACKETS_PER_PAGE whole packets, each page's granule position the 48 kHz sample count at the end
// of its last packet (decoded samples, the pre-skip among them: players drop it themselves).

const PACKETS_PER_PAGE = 50;           // one second of 20 ms packets
const VENDOR = "vox-ws demo";

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let r = i << 24;
    for (let j = 0; j < 8; j++) r = r & 0x80000000 ? (r << 1) ^ 0x04c11db7 : r << 1;
    table[i] = r >>> 0;
  }
  return table;
})();

// Ogg's CRC: polynomial 0x04c11db7, not reflected, initial value and final xor 0.
export function oggCrc(bytes) {
  let crc = 0;
  for (let i = 0; i < bytes.length; i++) crc = ((crc << 8) ^ CRC_TABLE[((crc >>> 24) ^ bytes[i]) & 0xff]) >>> 0;
  return crc >>> 0;
}

function page(packets, { granule, serial, sequence, first = false, last = false }) {
  const lacing = [];
  for (const packet of packets) {
    for (let left = packet.length; ; left -= 255) {
      lacing.push(Math.min(left, 255));
      if (left < 255) break;
    }
  }
  if (lacing.length > 255) throw new Error("too many packets for one Ogg page");
  const size = packets.reduce((n, p) => n + p.length, 0);
  const out = new Uint8Array(27 + lacing.length + size);
  const view = new DataView(out.buffer);
  out.set([0x4f, 0x67, 0x67, 0x53], 0);                  // "OggS"
  out[5] = (first ? 0x02 : 0) | (last ? 0x04 : 0);
  view.setBigInt64(6, BigInt(granule), true);
  view.setUint32(14, serial, true);
  view.setUint32(18, sequence, true);
  out[26] = lacing.length;
  out.set(lacing, 27);
  let at = 27 + lacing.length;
  for (const packet of packets) { out.set(packet, at); at += packet.length; }
  view.setUint32(22, oggCrc(out), true);
  return out;
}

function opusTags() {
  const vendor = new TextEncoder().encode(VENDOR);
  const out = new Uint8Array(8 + 4 + vendor.length + 4);
  const view = new DataView(out.buffer);
  out.set(new TextEncoder().encode("OpusTags"), 0);
  view.setUint32(8, vendor.length, true);
  out.set(vendor, 12);
  view.setUint32(12 + vendor.length, 0, true);           // no user comments
  return out;
}

// `head`: the OpusHead bytes; `packets`: Uint8Arrays in order; `durationsUs`: each one's length.
export function oggOpus(head, packets, durationsUs, serial = 0x766f78) {
  const pages = [page([head], { granule: 0, serial, sequence: 0, first: true }),
                 page([opusTags()], { granule: 0, serial, sequence: 1 })];
  let granule = 0;
  for (let start = 0; start < packets.length; start += PACKETS_PER_PAGE) {
    const group = packets.slice(start, start + PACKETS_PER_PAGE);
    for (let i = start; i < start + group.length; i++) granule += Math.round((durationsUs[i] * 48000) / 1e6);
    pages.push(page(group, { granule, serial, sequence: pages.length,
                             last: start + PACKETS_PER_PAGE >= packets.length }));
  }
  if (!packets.length) pages[pages.length - 1] = page([opusTags()], { granule: 0, serial, sequence: 1, last: true });
  return new Blob(pages, { type: "audio/ogg" });
}
