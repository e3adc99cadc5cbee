// Captures microphone samples for "clone my voice": forwards each input block to the page.
class RecorderProcessor extends AudioWorkletProcessor {
  process(inputs) {
    const input = inputs[0];
    if (input && input[0] && input[0].length) this.port.postMessage(input[0].slice(0));
    return true;
  }
}
registerProcessor("vox-recorder", RecorderProcessor);
