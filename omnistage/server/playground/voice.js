// The Voice tab: a spoken conversation over a /v1/realtime session. The page asks the server whether it
// offers realtime sessions and says so plainly where it does not; the microphone stays off until it does.

import { ApiError, call } from "./api.js";

export const ABSENT = "Realtime voice sessions are not available on this server.";

export class Voice {
  constructor() {
    this.$ = (id) => document.getElementById(id);
  }

  async probe() {
    const status = this.$("voice-status");
    const mic = this.$("voice-mic");
    mic.disabled = true;
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      status.textContent = "This browser gives the page no microphone (it needs https or localhost).";
      status.dataset.state = "no-microphone";
      return;
    }
    try {
      await call("/v1/realtime");
      status.textContent = "The server offers realtime sessions, but this page cannot open them yet.";
      status.dataset.state = "unsupported";
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) {
        status.textContent = ABSENT;
        status.dataset.state = "absent";
      } else if (err instanceof ApiError && err.status !== 401) {
        // a WebSocket route answers a plain GET with an error of its own: the sessions are there
        status.textContent = "The server offers realtime sessions, but this page cannot open them yet.";
        status.dataset.state = "unsupported";
      } else {
        status.textContent = err.message;
        status.dataset.state = "error";
      }
    }
  }
}
