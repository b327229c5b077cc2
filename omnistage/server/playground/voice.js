// The Voice tab: a spoken conversation over a /v1/realtime session (OpenAI's Realtime API). The microphone
// is captured by an AudioWorklet (capture.js) as 24 kHz pcm16 and appended to the session's input buffer;
// the server's VAD finds the turns and answers each; the answer's audio is played as it streams. Speaking
// over an answer stops its sound at once and tells the server how much of it was heard
// (conversation.item.truncate), so that the conversation holds only what the person heard.

import { apiKey } from "./api.js";
import { PcmPlayer, SAMPLE_RATE } from "./audio.js";

const MESSAGES = {
  NotAllowedError:
    "The browser denied the microphone. Allow it for this page (the address bar's site settings) and press Start talking again.",
  NotFoundError: "This device has no microphone.",
  NotReadableError: "The microphone is in use by another program.",
};
const REFUSED =
  "No realtime session could be opened at /v1/realtime: this server has none, or it refused the page's request.";
const KEYED =
  " Check the API key: a wrong one is refused.";

function base64(buffer) {
  const bytes = new Uint8Array(buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

export class Voice {
  constructor(page) {
    this.page = page;
    this.player = new PcmPlayer();
    this.socket = null;
    this.stream = null;
    this.capture = null;
    this.turns = []; // each turn as tests and the log read it: {role, text, latencyMs, state, ...}
    this.counts = { sentBytes: 0, receivedBytes: 0, truncations: 0 };
    this.response = null; // the answer under way: {id, itemId, turn, audioMs, firstAudio}
    this.user = null; // the user's turn being heard
    this.stoppedAt = null; // performance.now() at the last speech_stopped
    this.$ = (id) => document.getElementById(id);
    this.$("voice-mic").addEventListener("click", () => (this.socket ? this.stop() : this.start()));
  }

  // The tab is ready once the browser offers a microphone at all; whether the server has realtime sessions
  // is known when one is opened (a WebSocket's failed handshake tells a page nothing more).
  probe() {
    const mic = this.$("voice-mic");
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia || !window.AudioWorkletNode) {
      mic.disabled = true;
      this.status("This browser gives the page no microphone (it needs https or localhost).", "no-microphone");
      return;
    }
    mic.disabled = false;
    this.status("Press Start talking, then speak; the server hears where each turn ends.", "idle");
  }

  status(text, state) {
    const line = this.$("voice-status");
    line.textContent = text;
    line.dataset.state = state;
  }

  error(text) {
    this.$("voice-error").textContent = text;
  }

  // -- the session ---------------------------------------------------------------------------------------

  async start() {
    const mic = this.$("voice-mic");
    mic.disabled = true;
    this.error("");
    try {
      await this.player.ready(); // in the click's gesture, so that the answer may play
      try {
        this.stream = await navigator.mediaDevices.getUserMedia({
          audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true },
        });
      } catch (err) {
        this.status(MESSAGES[err.name] || `The microphone cannot be opened: ${err.message}`, "denied");
        return;
      }
      this.status("Opening a realtime session…", "connecting");
      const opened = await this.open();
      if (!opened) {
        this.release();
        this.status(REFUSED + (apiKey() ? KEYED : ""), "refused");
        return;
      }
      try {
        await this.listen();
      } catch (err) {
        this.stop();
        this.error(`The microphone's audio cannot be captured: ${err.message}`);
        return;
      }
      mic.textContent = "Stop";
      mic.setAttribute("aria-pressed", "true");
    } finally {
      mic.disabled = false;
    }
  }

  // The WebSocket, open (true) or refused (false).
  open() {
    const url = new URL("/v1/realtime", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    url.searchParams.set("model", this.page.model);
    const key = apiKey();
    const socket = key ? new WebSocket(url, ["realtime", `openai-insecure-api-key.${key}`]) : new WebSocket(url);
    return new Promise((resolve) => {
      socket.onopen = () => {
        this.socket = socket;
        socket.onmessage = (e) => this.receive(JSON.parse(e.data));
        socket.onclose = (e) => this.closed(e);
        resolve(true);
      };
      socket.onclose = () => resolve(false);
    });
  }

  // The session's settings, then the microphone's audio flowing into its input buffer.
  async listen() {
    const spoken = this.page.speakers.length > 0;
    const limit = Number(this.$("voice-max-tokens").value);
    const pcm = { type: "audio/pcm", rate: SAMPLE_RATE };
    this.send({
      type: "session.update",
      session: {
        type: "realtime",
        output_modalities: [spoken ? "audio" : "text"],
        max_output_tokens: limit > 0 ? limit : "inf",
        audio: {
          input: {
            format: pcm,
            turn_detection: { type: "server_vad", create_response: true, interrupt_response: true },
            transcription: { model: this.page.model },
          },
          output: spoken ? { format: pcm, voice: this.$("voice-voice").value } : { format: pcm },
        },
      },
    });
    this.capture = new AudioContext();
    await this.capture.audioWorklet.addModule("/playground/capture.js");
    const source = this.capture.createMediaStreamSource(this.stream);
    const worklet = new AudioWorkletNode(this.capture, "capture");
    worklet.port.onmessage = (e) => {
      if (this.send({ type: "input_audio_buffer.append", audio: base64(e.data) })) {
        this.counts.sentBytes += e.data.byteLength;
      }
    };
    // A node is run only while something downstream pulls it: a silent gain to the speakers.
    const mute = this.capture.createGain();
    mute.gain.value = 0;
    source.connect(worklet).connect(mute).connect(this.capture.destination);
  }

  // Whether the event went (nothing goes once the session is closed).
  send(event) {
    if (!this.socket || this.socket.readyState !== WebSocket.OPEN) return false;
    this.socket.send(JSON.stringify(event));
    return true;
  }

  stop() {
    const socket = this.socket;
    this.socket = null;
    if (socket) socket.close(1000);
    this.release();
    this.player.stop();
    this.endResponse("stopped");
    this.status("Stopped. Press Start talking to go on.", "stopped");
  }

  // The microphone and the capture graph let go.
  release() {
    if (this.stream) for (const track of this.stream.getTracks()) track.stop();
    if (this.capture) this.capture.close();
    this.stream = this.capture = null;
    const mic = this.$("voice-mic");
    mic.textContent = "Start talking";
    mic.setAttribute("aria-pressed", "false");
  }

  closed(event) {
    if (!this.socket) return; // stopped by the person
    this.socket = null;
    this.release();
    this.player.stop();
    this.endResponse("stopped");
    this.status(`The server closed the session (${event.code}${event.reason ? `: ${event.reason}` : ""}).`, "closed");
  }

  // -- the server's events -------------------------------------------------------------------------------

  receive(event) {
    const handler = this.handlers[event.type];
    if (handler) handler.call(this, event);
  }

  handlers = {
    "session.created"() {
      this.status("Listening: speak, and pause when you are done.", "listening");
    },
    "input_audio_buffer.speech_started"(e) {
      this.interrupt();
      this.user = this.addTurn("user", "You");
      this.user.itemId = e.item_id;
      this.user.startMs = e.audio_start_ms;
      this.status("Hearing you…", "hearing");
    },
    "input_audio_buffer.speech_stopped"(e) {
      this.stoppedAt = performance.now();
      if (this.user) {
        this.user.meta = `${((e.audio_end_ms - this.user.startMs) / 1000).toFixed(1)} s of speech`;
        this.draw(this.user);
      }
      this.status("Answering…", "answering");
    },
    "conversation.item.input_audio_transcription.delta"(e) {
      const turn = this.turnOf(e.item_id);
      if (turn) this.append(turn, e.delta);
    },
    "conversation.item.input_audio_transcription.completed"(e) {
      const turn = this.turnOf(e.item_id);
      if (turn) {
        turn.text = e.transcript;
        this.draw(turn);
      }
    },
    "response.created"(e) {
      this.player.stop();
      const turn = this.addTurn("assistant", "Model");
      turn.state = "streaming";
      this.response = { id: e.response.id, itemId: null, turn, audioMs: 0, heard: this.stoppedAt };
      this.draw(turn);
    },
    "response.output_item.added"(e) {
      if (this.response && e.item.type === "message") this.response.itemId = e.item.id;
    },
    "response.output_audio_transcript.delta"(e) {
      if (this.response) this.append(this.response.turn, e.delta);
    },
    "response.output_text.delta"(e) {
      if (this.response) this.append(this.response.turn, e.delta);
    },
    "response.output_audio.delta"(e) {
      const response = this.response;
      if (!response) return;
      const bytes = (e.delta.length * 3) / 4 - (e.delta.endsWith("==") ? 2 : e.delta.endsWith("=") ? 1 : 0);
      this.counts.receivedBytes += bytes;
      // as the server counts an item's audio: whole milliseconds of each piece
      response.audioMs += Math.floor((bytes / 2) * 1000 / SAMPLE_RATE);
      if (response.turn.latencyMs === undefined && response.heard !== null) {
        response.turn.latencyMs = Math.round(performance.now() - response.heard);
        this.draw(response.turn);
      }
      this.player.pushBase64(e.delta);
    },
    "response.done"(e) {
      const status = e.response.status;
      const reason = e.response.status_details && e.response.status_details.reason;
      this.endResponse(status === "cancelled" && reason === "turn_detected" ? "interrupted" : status);
      const hearing = this.$("voice-status").dataset.state === "hearing";
      if (this.socket && !hearing) this.status("Listening: speak, and pause when you are done.", "listening");
    },
    "conversation.item.truncated"(e) {
      const turn = this.turnOf(e.item_id);
      if (turn) {
        turn.truncatedMs = e.audio_end_ms;
        this.draw(turn);
      }
    },
    error(e) {
      this.error(e.error.message);
    },
  };

  // The person spoke over the answer: its sound stops now, and the server learns how much was heard.
  interrupt() {
    const response = this.response;
    const heardMs = Math.floor(this.player.played() * 1000);
    const sounding = this.player.playing || (response && response.turn.state === "streaming");
    this.player.stop();
    const turn = response ? response.turn : this.turns.findLast((t) => t.role === "assistant");
    const itemId = response ? response.itemId : turn && turn.itemId;
    if (!sounding || !turn || !itemId || !(response ? response.audioMs : turn.audioMs)) return;
    const audioEndMs = Math.min(heardMs, response ? response.audioMs : turn.audioMs);
    this.send({ type: "conversation.item.truncate", item_id: itemId, content_index: 0, audio_end_ms: audioEndMs });
    this.counts.truncations += 1;
    turn.state = "interrupted";
    this.draw(turn);
  }

  endResponse(status) {
    const response = this.response;
    if (!response) return;
    this.response = null;
    const turn = response.turn;
    turn.itemId = response.itemId;
    turn.audioMs = response.audioMs;
    if (turn.state === "streaming") turn.state = status;
    this.draw(turn);
  }

  // -- the transcript ------------------------------------------------------------------------------------

  turnOf(itemId) {
    return this.turns.find((t) => t.itemId === itemId);
  }

  addTurn(role, who) {
    const li = document.createElement("li");
    li.className = role;
    const name = document.createElement("span");
    name.className = "who";
    name.textContent = who;
    const text = document.createElement("span");
    text.className = "text";
    const meta = document.createElement("span");
    meta.className = "meta muted";
    li.append(name, text, meta);
    this.$("voice-log").append(li);
    const turn = { role, text: "", state: "done", li };
    this.turns.push(turn);
    this.draw(turn);
    li.scrollIntoView({ block: "nearest" });
    return turn;
  }

  append(turn, delta) {
    turn.text += delta;
    this.draw(turn);
  }

  draw(turn) {
    const li = turn.li;
    li.classList.toggle("streaming", turn.state === "streaming");
    li.dataset.state = turn.state;
    li.querySelector(".text").textContent = turn.text || (turn.role === "user" ? "(spoken)" : "");
    const meta = [];
    if (turn.meta) meta.push(turn.meta);
    if (turn.latencyMs !== undefined) meta.push(`first audio ${turn.latencyMs} ms after you stopped`);
    if (turn.state === "interrupted") meta.push("interrupted");
    if (turn.truncatedMs !== undefined) meta.push(`heard ${(turn.truncatedMs / 1000).toFixed(1)} s`);
    if (turn.state === "failed" || turn.state === "incomplete") meta.push(turn.state);
    li.querySelector(".meta").textContent = meta.join(" · ");
    if (turn.latencyMs !== undefined) li.dataset.latencyMs = String(turn.latencyMs);
  }

  // What tests read: the turns without their elements, and the audio's counts.
  state() {
    return {
      turns: this.turns.map(({ li, ...turn }) => turn),
      ...this.counts,
      player: this.player.state(),
      open: this.socket !== null,
    };
  }
}
