// The Chat tab: turns streamed from /v1/chat/completions, with attachments as data: URLs in content parts,
// and spoken answers played as their pcm16 arrives. The history goes with every turn; a spoken answer goes
// back by its audio id, as OpenAI's multi-turn audio does.

import { ApiError, dataUrl, events, postJson } from "./api.js";

const PARTS = {
  image: (url) => ({ type: "image_url", image_url: { url } }),
  audio: (url) => ({ type: "audio_url", audio_url: { url } }),
  video: (url) => ({ type: "video_url", video_url: { url } }),
};

export class Chat {
  constructor(page, player) {
    this.page = page;
    this.player = player;
    this.history = [];
    this.attachments = []; // {kind, name, url}
    this.controller = null;
    this.$ = (id) => document.getElementById(id);
    this.$("chat-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    this.$("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    this.$("chat-file").addEventListener("change", (e) => this.attach(e.target.files));
    this.$("chat-stop").addEventListener("click", () => this.stop());
    this.$("chat-clear").addEventListener("click", () => this.clear());
  }

  async attach(files) {
    for (const file of files) {
      const kind = file.type.split("/")[0];
      if (!(kind in PARTS)) {
        this.$("chat-error").textContent = `${file.name}: not an image, audio clip or video`;
        continue;
      }
      this.attachments.push({ kind, name: file.name, url: await dataUrl(file) });
    }
    this.$("chat-file").value = "";
    this.drawAttachments();
  }

  drawAttachments() {
    const list = this.$("attachments");
    list.replaceChildren(
      ...this.attachments.map((item, i) => {
        const chip = document.createElement("li");
        chip.textContent = `${item.kind}: ${item.name} `;
        const remove = document.createElement("button");
        remove.type = "button";
        remove.textContent = "×";
        remove.setAttribute("aria-label", `remove ${item.name}`);
        remove.addEventListener("click", () => {
          this.attachments.splice(i, 1);
          this.drawAttachments();
        });
        chip.append(remove);
        return chip;
      }),
    );
  }

  userMessage(text) {
    if (!this.attachments.length) return { role: "user", content: text };
    const parts = this.attachments.map((a) => PARTS[a.kind](a.url));
    if (text) parts.push({ type: "text", text });
    return { role: "user", content: parts };
  }

  request(spoken) {
    const body = {
      model: this.page.model,
      messages: this.history,
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: Number(this.$("chat-max-tokens").value) || undefined,
    };
    if (spoken) {
      body.modalities = ["text", "audio"];
      body.audio = { voice: this.$("chat-voice").value, format: "pcm16" };
    }
    if (this.$("use-audio-in-video").checked && this.history.some(hasVideo)) body.use_audio_in_video = true;
    return body;
  }

  async send() {
    const input = this.$("chat-input");
    const text = input.value.trim();
    if (this.controller || (!text && !this.attachments.length)) return;
    const spoken = this.$("chat-modalities").value === "audio";
    if (spoken) await this.player.ready();
    this.player.reset();
    const message = this.userMessage(text);
    this.history.push(message);
    this.entry("user", text, this.attachments.map((a) => `${a.kind}: ${a.name}`));
    input.value = "";
    this.attachments = [];
    this.drawAttachments();
    this.$("chat-error").textContent = "";
    const answer = this.entry("assistant", "");
    answer.classList.add("streaming");
    this.busy(true);
    let textOut = "";
    let audioId = null;
    try {
      const response = await postJson("/v1/chat/completions", this.request(spoken), this.controller.signal);
      for await (const chunk of events(response)) {
        const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta : null;
        if (!delta) continue;
        if (delta.content) textOut += delta.content;
        if (delta.audio) {
          if (delta.audio.id) audioId = delta.audio.id;
          if (delta.audio.transcript) textOut += delta.audio.transcript;
          if (delta.audio.data) this.player.pushBase64(delta.audio.data);
        }
        answer.querySelector(".text").textContent = textOut;
        if (spoken) answer.querySelector(".meta").textContent = audioMeta(this.player);
      }
      this.history.push(audioId ? { role: "assistant", audio: { id: audioId } } : { role: "assistant", content: textOut });
    } catch (err) {
      this.history.pop(); // the turn did not happen: the next one is sent without it
      if (err.name === "AbortError") {
        answer.querySelector(".meta").textContent = "stopped";
      } else {
        answer.remove();
        this.$("chat-error").textContent = err instanceof ApiError ? err.message : String(err);
      }
    } finally {
      answer.classList.remove("streaming");
      this.busy(false);
    }
  }

  entry(role, text, notes = []) {
    const item = document.createElement("li");
    item.className = role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "Model";
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    const meta = document.createElement("span");
    meta.className = "meta muted";
    meta.textContent = notes.join(", ");
    item.append(who, body, meta);
    this.$("chat-log").append(item);
    item.scrollIntoView({ block: "end" });
    return item;
  }

  busy(on) {
    this.controller = on ? new AbortController() : null;
    this.$("chat-send").disabled = on;
    this.$("chat-stop").disabled = !on;
  }

  stop() {
    if (this.controller) this.controller.abort();
    this.player.stop();
  }

  clear() {
    this.stop();
    this.history = [];
    this.$("chat-log").replaceChildren();
    this.$("chat-error").textContent = "";
  }
}

function hasVideo(message) {
  return Array.isArray(message.content) && message.content.some((part) => part.type === "video_url");
}

function audioMeta(player) {
  const s = player.state();
  return `${(s.receivedBytes / 1024).toFixed(1)} KiB of audio, ${s.scheduledSeconds.toFixed(2)} s`;
}
