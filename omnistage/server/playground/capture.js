// The microphone's AudioWorklet: the context's samples (48 kHz or whatever the device runs at) resampled to
// the 24 kHz pcm16 a realtime session takes, posted to the page in 40 ms pieces.
//
// Each output sample is the mean of the input samples in its 1/24000 s (a box filter: enough against aliasing
// for speech, and exact where the input rate is a multiple of 24 kHz).

const RATE = 24000;
const PIECE = RATE / 25; // 40 ms

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / RATE; // input samples per output sample
    this.until = this.step; // where the output sample being summed ends, in input samples from here
    this.sum = 0;
    this.count = 0;
    this.out = new Int16Array(PIECE);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    for (let i = 0; i < channel.length; i++) {
      this.sum += channel[i];
      this.count += 1;
      if (this.count < this.until) continue;
      const mean = Math.max(-1, Math.min(1, this.sum / this.count));
      this.out[this.filled++] = Math.round(mean * 32767);
      this.until += this.step - this.count;
      this.sum = 0;
      this.count = 0;
      if (this.filled === PIECE) {
        this.port.postMessage(this.out.buffer, [this.out.buffer]);
        this.out = new Int16Array(PIECE);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor("capture", Capture);
