// The playground page: tabs, the API key, the model and its voices; each tab is a module of its own.

import { ApiError, apiKey, json, keyEvents, setApiKey } from "./api.js";
import { PcmPlayer } from "./audio.js";
import { Chat } from "./chat.js";
import { ServerView } from "./server.js";
import { Speech } from "./speech.js";
import { Voice } from "./voice.js";

const $ = (id) => document.getElementById(id);

class Page {
  constructor() {
    this.model = null;
    this.speakers = [];
    this.player = new PcmPlayer();
    this.chat = new Chat(this, this.player);
    this.speech = new Speech(this, this.player);
    this.server = new ServerView();
    this.voice = new Voice(this);
    this.tabs();
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      setApiKey($("key-input").value.trim());
      this.connect();
    });
    $("forget-key").addEventListener("click", () => {
      setApiKey(null);
      location.reload();
    });
    keyEvents.addEventListener("unauthorized", (e) => this.askKey(e.detail));
  }

  // The model's card, then what depends on it; a 401 asks for the key (keyEvents), anything else is shown.
  async connect() {
    let models;
    try {
      models = await json("/v1/models");
    } catch (err) {
      if (!(err instanceof ApiError) || err.status !== 401) $("model-name").textContent = err.message;
      return;
    }
    $("key-form").hidden = true;
    $("key-error").textContent = "";
    $("forget-key").hidden = !apiKey();
    const card = models.data[0];
    this.model = card.id;
    $("model-name").textContent = card.id;
    document.title = `${card.id} · omnistage playground`;
    this.server.showCard(card);
    await this.loadVoices();
    this.voice.probe();
    document.body.dataset.ready = "true";
  }

  askKey(message) {
    const form = $("key-form");
    form.hidden = false;
    $("key-error").textContent = apiKey() ? message : "";
    $("model-name").textContent = "an API key is needed";
    $("key-input").focus();
  }

  async loadVoices() {
    let listing;
    try {
      listing = await json("/v1/audio/voices");
    } catch (err) {
      $("speak-error").textContent = err.message;
      listing = { voices: [], aliases: {} };
    }
    this.speakers = listing.voices;
    for (const select of document.querySelectorAll(".voice-select")) {
      const options = listing.voices.map((v) => new Option(v, v));
      const aliases = Object.entries(listing.aliases || {});
      if (aliases.length) {
        const group = document.createElement("optgroup");
        group.label = "OpenAI's names";
        group.append(...aliases.map(([alias, speaker]) => new Option(`${alias} (${speaker})`, alias)));
        options.push(group);
      }
      select.replaceChildren(...options);
    }
    const speaks = listing.voices.length > 0;
    $("chat-modalities").querySelector('[value="audio"]').disabled = !speaks;
    for (const id of ["speak-send", "speak-each"]) $(id).disabled = !speaks;
    if (!speaks) $("speak-status").textContent = "This model does not speak.";
  }

  // WAI-ARIA tabs: arrows, Home and End move between the tabs, the panel follows.
  tabs() {
    const tabs = [...document.querySelectorAll('[role="tab"]')];
    const select = (tab) => {
      for (const t of tabs) {
        const on = t === tab;
        t.setAttribute("aria-selected", String(on));
        t.tabIndex = on ? 0 : -1;
        $(t.getAttribute("aria-controls")).hidden = !on;
      }
    };
    for (const [i, tab] of tabs.entries()) {
      tab.addEventListener("click", () => select(tab));
      tab.addEventListener("keydown", (e) => {
        const next = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[e.key];
        if (next === undefined) return;
        e.preventDefault();
        const target = tabs[(next + tabs.length) % tabs.length];
        select(target);
        target.focus();
      });
    }
  }
}

const page = new Page();
window.playground = page; // what the browser tests read: the player's counts, the history
page.server.start();
page.connect();
