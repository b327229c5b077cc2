// Plays 16-bit little-endian mono pcm at 24 kHz (what chat's streamed audio and /v1/audio/speech's `pcm`
// carry) with the Web Audio API, each piece scheduled right after the one before as it arrives.

export const SAMPLE_RATE = 24000;

export class PcmPlayer {
  constructor() {
    this.context = null;
    this.sources = new Set();
    this.nextTime = 0;
    this.odd = null; // a byte left over from a piece cut between a sample's two bytes
    this.receivedBytes = 0;
    this.scheduledSeconds = 0;
    this.started = 0; // pieces started playing
    this.scheduled = []; // [start, duration] of each piece since the last stop, in the context's time
  }

  // Called from a click (a user gesture), so that the browser lets the context run.
  async ready() {
    if (!this.context) this.context = new AudioContext({ sampleRate: SAMPLE_RATE });
    if (this.context.state === "suspended") await this.context.resume();
  }

  // A new answer: what is still playing stops, the counts start again.
  reset() {
    this.stop();
    this.receivedBytes = 0;
    this.scheduledSeconds = 0;
    this.started = 0;
  }

  stop() {
    for (const source of this.sources) source.stop();
    this.sources.clear();
    this.scheduled = [];
    this.nextTime = 0;
    this.odd = null;
  }

  // Seconds of the pieces scheduled since the last stop that have been heard by now (gaps between pieces,
  // where the stream fell behind, are not counted): where an interrupted answer was cut.
  played() {
    if (!this.context) return 0;
    const now = this.context.currentTime;
    return this.scheduled.reduce((sum, [at, duration]) => sum + Math.min(Math.max(now - at, 0), duration), 0);
  }

  get playing() {
    return this.sources.size > 0;
  }

  pushBase64(data) {
    const text = atob(data);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    this.push(bytes);
  }

  push(bytes) {
    this.receivedBytes += bytes.length;
    if (this.odd !== null) {
      const joined = new Uint8Array(bytes.length + 1);
      joined[0] = this.odd;
      joined.set(bytes, 1);
      bytes = joined;
      this.odd = null;
    }
    if (bytes.length % 2) {
      this.odd = bytes[bytes.length - 1];
      bytes = bytes.subarray(0, bytes.length - 1);
    }
    if (!bytes.length || !this.context) return;
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
    const samples = new Float32Array(bytes.length / 2);
    for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
    const buffer = this.context.createBuffer(1, samples.length, SAMPLE_RATE);
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const at = Math.max(this.nextTime, this.context.currentTime + 0.05);
    source.onended = () => this.sources.delete(source);
    source.start(at);
    this.sources.add(source);
    this.started += 1;
    this.scheduled.push([at, buffer.duration]);
    this.nextTime = at + buffer.duration;
    this.scheduledSeconds += buffer.duration;
  }

  // What tests and the page's status lines read.
  state() {
    return {
      context: this.context ? this.context.state : "none",
      receivedBytes: this.receivedBytes,
      scheduledSeconds: this.scheduledSeconds,
      pieces: this.started,
    };
  }
}
