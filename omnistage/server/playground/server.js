// The server tab: the model card, each device's memory plan, and KV pages and request latency over the last
// minutes, from /metrics read every few seconds while the page is visible.

import { ApiError } from "./api.js";
import { drawLine, memoryPlans, parseMetrics, planBar, value } from "./charts.js";

const EVERY_MS = 2000;
const SPAN_MS = 5 * 60 * 1000;

export class ServerView {
  constructor() {
    this.$ = (id) => document.getElementById(id);
    this.kv = [];
    this.latency = [];
    this.last = null; // the latency histogram's sum and count at the last reading
    this.planDrawn = false;
  }

  showCard(card) {
    const facts = {
      model: card.id,
      checkpoint: card.root,
      "context (tokens)": card.max_model_len,
      "owned by": card.owned_by,
    };
    this.$("model-card").replaceChildren(
      ...Object.entries(facts)
        .filter(([, v]) => v !== undefined && v !== null)
        .flatMap(([k, v]) => {
          const dt = document.createElement("dt");
          dt.textContent = k;
          const dd = document.createElement("dd");
          dd.textContent = String(v);
          return [dt, dd];
        }),
    );
  }

  start() {
    const tick = async () => {
      if (document.visibilityState === "visible") await this.poll();
      this.timer = setTimeout(tick, EVERY_MS);
    };
    tick();
  }

  async poll() {
    let text;
    try {
      const response = await fetch("/metrics");
      if (!response.ok) throw new ApiError(`/metrics answered ${response.status}`, response.status);
      text = await response.text();
    } catch (err) {
      this.$("server-error").textContent = err instanceof ApiError ? err.message : `/metrics: ${err.message}`;
      return;
    }
    this.$("server-error").textContent = "";
    this.read(parseMetrics(text), Date.now());
  }

  read(samples, now) {
    if (!this.planDrawn) this.drawPlan(samples);
    const used = value(samples, "omnistage_kv_pages_used");
    const total = value(samples, "omnistage_kv_pages_total");
    if (used !== null) {
      this.kv.push({ t: now, v: used });
      this.$("kv-now").textContent = `${used} of ${total}`;
    }
    const sum = value(samples, "omnistage_request_latency_seconds_sum");
    const count = value(samples, "omnistage_request_latency_seconds_count");
    if (sum !== null && count !== null) {
      // the mean latency of the requests that ended since the last reading (none ended: no point)
      if (this.last && count > this.last.count) {
        const mean = (sum - this.last.sum) / (count - this.last.count);
        this.latency.push({ t: now, v: mean });
        this.$("latency-now").textContent = `${(mean * 1000).toFixed(0)} ms, mean of the last ${count - this.last.count}`;
      }
      this.last = { sum, count };
    }
    this.kv = this.kv.filter((p) => now - p.t <= SPAN_MS);
    this.latency = this.latency.filter((p) => now - p.t <= SPAN_MS);
    drawLine(this.$("kv-chart"), this.kv, SPAN_MS);
    drawLine(this.$("latency-chart"), this.latency, SPAN_MS);
  }

  // The plan is fixed at start: drawn from the first reading.
  drawPlan(samples) {
    const plans = memoryPlans(samples);
    const box = this.$("memory-plan");
    const devices = Object.keys(plans).sort();
    if (!devices.length) {
      const note = document.createElement("p");
      note.className = "muted no-plan";
      note.textContent = "No GPU memory plan: this server runs on the CPU, where memory is not planned.";
      box.replaceChildren(note);
    } else {
      box.replaceChildren(...devices.map((device) => planBar(device, plans[device])));
    }
    box.dataset.devices = String(devices.length);
    this.planDrawn = true;
  }
}
