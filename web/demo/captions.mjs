// The captions of the stream being played: its words where they are timed (the engine's or
// the aligner's `words` messages), else its segments (`segment` messages), in order, each with its place in
// the stream's own timeline, and which one is being heard at a moment of playback.

export class CaptionTrack {
  // `byWords`: the stream asked for word timings; its segments are then left out.
  constructor(byWords) {
    this.byWords = byWords;
    this.items = [];       // {text, start_s, end_s}, in the order spoken
  }

  // Returns the items added, for the page to show.
  addWords(words) {
    if (!this.byWords) return [];
    const added = words.map((w) => ({ text: w.word, start_s: w.start_s, end_s: w.end_s }));
    this.items.push(...added);
    return added;
  }

  addSegment(segment) {
    if (this.byWords) return [];
    const added = { text: segment.text, start_s: segment.start_s, end_s: segment.end_s };
    this.items.push(added);
    return [added];
  }

  // The item being heard `seconds` into the stream's audio: the last one started by then (a
  // pause between words keeps the word before it lit); -1 before the first.
  indexAt(seconds) {
    let low = 0;
    let high = this.items.length;
    while (low < high) {
      const mid = (low + high) >> 1;
      if (this.items[mid].start_s <= seconds) low = mid + 1;
      else high = mid;
    }
    return low - 1;
  }
}
