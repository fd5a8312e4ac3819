// The API from the page: the bearer token (sessionStorage, never a URL), JSON calls, and the
// server-sent events of a fetch() body. EventSource cannot send an Authorization header, so
// streams are read from fetch()'s ReadableStream (docs/console.md).

const TOKEN_KEY = "lmspd.token";

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

export class Unauthorized extends Error {}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

export function headers(extra = {}) {
  const h = { ...extra };
  const t = token();
  if (t) h.Authorization = `Bearer ${t}`;
  return h;
}

function message(body, status) {
  if (body && typeof body === "object") {
    if (body.error && body.error.message) return body.error.message; // OpenAI's envelope (/v1)
    if (body.detail) return body.detail; // a problem object (/lmsp/v1)
    if (body.title) return body.title;
  }
  return `HTTP ${status}`;
}

export async function check(response) {
  if (response.status === 401) {
    document.dispatchEvent(new CustomEvent("lmspd:unauthorized"));
    throw new Unauthorized("a token is needed");
  }
  if (!response.ok) {
    let body = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    throw new ApiError(response.status, message(body, response.status), body);
  }
  return response;
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, signal, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await check(await fetch(path, init));
  const text = await response.text();
  return text ? JSON.parse(text) : null;
}

// Server-sent events (the WHATWG parsing rules) from a fetch() response body: yields
// {event, data, id, retry} per dispatched event; comments (keep-alives) are skipped.
export async function* frames(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let frame = { event: "message", data: [], id: null, retry: null };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let cut;
      while ((cut = buffer.search(/\r\n|\r|\n/)) >= 0) {
        const line = buffer.slice(0, cut);
        buffer = buffer.slice(cut + (buffer.startsWith("\r\n", cut) ? 2 : 1));
        if (line === "") {
          if (frame.data.length) yield { event: frame.event, data: frame.data.join("\n"), id: frame.id, retry: frame.retry };
          frame = { event: "message", data: [], id: null, retry: null };
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") frame.data.push(value);
        else if (field === "event") frame.event = value;
        else if (field === "id") frame.id = value;
        else if (field === "retry" && /^\d+$/.test(value)) frame.retry = Number(value);
      }
    }
  } finally {
    reader.releaseLock();
  }
}

const FINAL = new Set(["response.completed", "response.incomplete", "response.failed", "response.cancelled"]);

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

// Follows an LMSP task's event stream to its final event (docs/lmsp.md §6.4, §7.4), reconnecting
// with Last-Event-ID whenever the connection drops or the server ends the stream early (a
// restart): no gap, no duplicate. onState("live" | "reconnecting") says which it is doing.
export async function followTask(taskId, { onEvent, onState, signal, after = -1 }) {
  let last = after;
  let delay = 1000;
  while (!signal?.aborted) {
    try {
      const h = headers({ Accept: "text/event-stream" });
      if (last >= 0) h["Last-Event-ID"] = String(last);
      const response = await check(await fetch(`/lmsp/v1/tasks/${encodeURIComponent(taskId)}/events`, { headers: h, signal, cache: "no-store" }));
      onState("live");
      for await (const frame of frames(response.body)) {
        if (frame.retry !== null) delay = Math.min(Math.max(frame.retry, 250), 5000);
        if (frame.id !== null && /^\d+$/.test(frame.id)) last = Number(frame.id);
        const event = JSON.parse(frame.data);
        onEvent(event);
        if (FINAL.has(event.type)) return event;
      }
    } catch (err) {
      if (signal?.aborted) return null;
      if (err instanceof Unauthorized) throw err;
      if (err instanceof ApiError && err.status < 500) throw err; // gone, expired: retrying will not help
    }
    if (signal?.aborted) return null;
    onState("reconnecting");
    await sleep(delay, signal);
  }
  return null;
}
