// The server's public API as the page calls it: the API key, error messages in OpenAI's shape, SSE streams.

const KEY = "omnistage-api-key";

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY);
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

// A 401 anywhere asks for the key again (app.js listens).
export const keyEvents = new EventTarget();

// fetch() with the key; a response that is not ok becomes an ApiError carrying the server's own message.
export async function call(path, init = {}) {
  const headers = new Headers(init.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  let response;
  try {
    response = await fetch(path, { ...init, headers });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(`the server cannot be reached (${err.message})`, 0);
  }
  if (response.ok) return response;
  const message = await errorMessage(response);
  if (response.status === 401) keyEvents.dispatchEvent(new CustomEvent("unauthorized", { detail: message }));
  throw new ApiError(message, response.status);
}

export async function json(path, init) {
  return (await call(path, init)).json();
}

export function postJson(path, body, signal) {
  return call(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal,
  });
}

async function errorMessage(response) {
  const text = await response.text();
  try {
    const error = JSON.parse(text).error;
    if (error && error.message) return `${response.status}: ${error.message}`;
  } catch {
    // not JSON: the text itself, below
  }
  return `${response.status}: ${text || response.statusText}`;
}

// Each `data:` payload of an SSE response, parsed, as it arrives; stops at [DONE]. An `error` payload (a
// failure after the stream began) is thrown as an ApiError.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(event.error.message || JSON.stringify(event.error), 0);
      yield event;
    }
  }
}

// A File as a data: URL, for content parts.
export function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}
