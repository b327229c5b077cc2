// The "Transcribe & speak" tab: a dropped file to /v1/audio/transcriptions (its text streamed), and typed
// text to /v1/audio/speech as raw pcm, played as it is decoded.

import { ApiError, call, events, postJson } from "./api.js";

export class Speech {
  constructor(page, player) {
    this.page = page;
    this.player = player;
    this.controller = null;
    const $ = (this.$ = (id) => document.getElementById(id));
    const drop = $("drop");
    drop.addEventListener("dragover", (e) => {
      e.preventDefault();
      drop.classList.add("over");
    });
    drop.addEventListener("dragleave", () => drop.classList.remove("over"));
    drop.addEventListener("drop", (e) => {
      e.preventDefault();
      drop.classList.remove("over");
      if (e.dataTransfer.files.length) this.transcribe(e.dataTransfer.files[0]);
    });
    drop.addEventListener("keydown", (e) => {
      if (e.key === "Enter" || e.key === " ") {
        e.preventDefault();
        $("transcribe-file").click();
      }
    });
    $("transcribe-file").addEventListener("change", (e) => {
      if (e.target.files.length) this.transcribe(e.target.files[0]);
      e.target.value = "";
    });
    $("speak-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.speak([$("speak-voice").value]);
    });
    $("speak-each").addEventListener("click", () => this.speak(this.page.speakers));
    $("speak-stop").addEventListener("click", () => this.stop());
  }

  async transcribe(file) {
    const out = this.$("transcript");
    out.textContent = `${file.name}: …`;
    this.$("transcribe-error").textContent = "";
    const form = new FormData();
    form.append("file", file);
    form.append("model", this.page.model);
    form.append("stream", "true");
    const language = this.$("transcribe-language").value.trim();
    if (language) form.append("language", language);
    try {
      const response = await call("/v1/audio/transcriptions", { method: "POST", body: form });
      let text = "";
      for await (const event of events(response)) {
        if (event.type === "transcript.text.delta") text += event.delta;
        if (event.type === "transcript.text.done") text = event.text;
        out.textContent = text;
      }
      out.dataset.done = "true";
    } catch (err) {
      out.textContent = "";
      this.$("transcribe-error").textContent = err instanceof ApiError ? err.message : String(err);
    }
  }

  // Speaks the text in each of `voices` in turn.
  async speak(voices) {
    const input = this.$("speak-input").value.trim();
    if (!input || this.controller) return;
    await this.player.ready();
    this.player.reset();
    this.$("speak-error").textContent = "";
    this.busy(true);
    try {
      for (const [i, voice] of voices.entries()) {
        if (i > 0) await this.untilQuiet();
        this.$("speak-status").textContent = `${voice}: …`;
        const body = { model: this.page.model, input, voice, response_format: "pcm" };
        const response = await postJson("/v1/audio/speech", body, this.controller.signal);
        const reader = response.body.getReader();
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          this.player.push(value);
          const s = this.player.state();
          this.$("speak-status").textContent = `${voice}: ${s.scheduledSeconds.toFixed(2)} s received`;
        }
      }
      this.$("speak-status").dataset.done = "true";
    } catch (err) {
      if (err.name !== "AbortError") {
        this.$("speak-error").textContent = err instanceof ApiError ? err.message : String(err);
      }
    } finally {
      this.busy(false);
    }
  }

  // Each voice in turn: the next starts once the one before has played out.
  async untilQuiet() {
    while (this.player.playing && this.controller && !this.controller.signal.aborted) {
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
  }

  busy(on) {
    this.controller = on ? new AbortController() : null;
    this.$("speak-send").disabled = on;
    this.$("speak-each").disabled = on;
    this.$("speak-stop").disabled = !on;
  }

  stop() {
    if (this.controller) this.controller.abort();
    this.player.stop();
  }
}
