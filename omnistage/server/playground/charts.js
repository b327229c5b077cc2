// Prometheus text read into samples, and the two drawings of the server tab: a device's memory plan as one
// bar, and a small line chart of recent readings. Hand-written SVG: the page loads nothing from elsewhere.

const SVG = "http://www.w3.org/2000/svg";

// The exposition text as [{name, labels, value}] (comments skipped).
export function parseMetrics(text) {
  const samples = [];
  const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const row of text.split("\n")) {
    if (!row || row.startsWith("#")) continue;
    const m = line.exec(row);
    if (!m) continue;
    const labels = {};
    for (const [, key, value] of (m[2] || "").matchAll(label)) labels[key] = value.replace(/\\(.)/g, "$1");
    samples.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return samples;
}

export function value(samples, name) {
  const sample = samples.find((s) => s.name === name && !Object.keys(s.labels).length);
  return sample ? sample.value : null;
}

// The parts of a device's plan in the order they are drawn, with their colour's CSS variable.
export const PARTS = ["weights", "kv", "graphs", "floor", "reserve", "free"];
const NAMES = { weights: "weights", kv: "KV pages", graphs: "CUDA graphs", floor: "floor", reserve: "reserve", free: "free" };

// omnistage_memory_plan_bytes by device: {device: {total, parts: {part: bytes}, stages: Set}}.
export function memoryPlans(samples) {
  const plans = {};
  for (const s of samples) {
    if (s.name !== "omnistage_memory_plan_bytes") continue;
    const plan = (plans[s.labels.device] ??= { total: 0, parts: {}, stages: new Set() });
    if (s.labels.stage) plan.stages.add(s.labels.stage);
    if (s.labels.part === "total") plan.total = s.value;
    else plan.parts[s.labels.part] = (plan.parts[s.labels.part] || 0) + s.value;
  }
  return plans;
}

export function gib(bytes) {
  return `${(bytes / 2 ** 30).toFixed(bytes < 2 ** 30 ? 2 : 1)} GiB`;
}

// One device's plan: a bar split by part, and a legend with each part's size.
export function planBar(device, plan) {
  const figure = document.createElement("figure");
  figure.className = "plan";
  const caption = document.createElement("figcaption");
  caption.textContent = `${device}: ${gib(plan.total)}` + (plan.stages.size ? ` (${[...plan.stages].join(", ")})` : "");
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 1000 40");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("role", "img");
  svg.classList.add("bar");
  const legend = document.createElement("ul");
  legend.className = "legend";
  let x = 0;
  const total = plan.total || PARTS.reduce((sum, part) => sum + (plan.parts[part] || 0), 0);
  const described = [];
  for (const part of PARTS) {
    const bytes = plan.parts[part] || 0;
    if (!bytes) continue;
    const width = (1000 * bytes) / total;
    const rect = document.createElementNS(SVG, "rect");
    rect.setAttribute("x", x);
    rect.setAttribute("y", 0);
    rect.setAttribute("width", width);
    rect.setAttribute("height", 40);
    rect.setAttribute("class", `part-${part}`);
    rect.dataset.part = part;
    const title = document.createElementNS(SVG, "title");
    title.textContent = `${NAMES[part]}: ${gib(bytes)}`;
    rect.append(title);
    svg.append(rect);
    x += width;
    const item = document.createElement("li");
    item.innerHTML = `<span class="swatch part-${part}"></span>`;
    item.append(`${NAMES[part]} ${gib(bytes)}`);
    legend.append(item);
    described.push(title.textContent);
  }
  svg.setAttribute("aria-label", `${device} memory plan: ${described.join(", ")}`);
  figure.append(caption, svg, legend);
  return figure;
}

// A line of `points` ([{t, v}], t in ms) over the last `span` ms, scaled to the highest of them, with a dot
// on the newest (a single reading is a dot alone).
export function drawLine(svg, points, span) {
  const now = Date.now();
  const recent = points.filter((p) => now - p.t <= span);
  const top = Math.max(...recent.map((p) => p.v), 1e-9);
  const xy = recent.map((p) => [300 * (1 - (now - p.t) / span), 98 - (90 * p.v) / top]);
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", xy.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" "));
  line.setAttribute("vector-effect", "non-scaling-stroke");
  svg.replaceChildren(line);
  if (xy.length) {
    const [x, y] = xy[xy.length - 1];
    const dot = document.createElementNS(SVG, "line");
    dot.setAttribute("x1", x);
    dot.setAttribute("x2", x);
    dot.setAttribute("y1", y);
    dot.setAttribute("y2", y);
    dot.setAttribute("vector-effect", "non-scaling-stroke");
    dot.classList.add("dot");
    svg.append(dot);
  }
  svg.dataset.points = String(xy.length);
}
