// Chat: /v1/responses streamed (stream: true), stored, each turn chained to the last with
// previous_response_id. The conversation is a list of response ids and the settings (the system
// prompt among them); after a reload each turn's text is read back from the server (GET
// /v1/responses/{id} and its input_items), never from the browser.

import { api, ApiError, check, frames, headers, token } from "./api.js";
import { errorText, field, h } from "./dom.js";

const KEY = "lmspd.chat";

// Whose conversation it is (docs/console.md, "Tokens and ownership"): under a token it is kept
// beside the token, in this tab's sessionStorage, so the next person to sign in on this browser
// (after a sign-out, or in a new tab) never sends it; without tokens (loopback, one owner) in
// localStorage, across tabs.
function storage() {
  return token() ? sessionStorage : localStorage;
}

// Sign-out, a refused token and a new sign-in: nothing of the last conversation stays.
export function forgetChat() {
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
}

function load(store) {
  try {
    const saved = JSON.parse(store.getItem(KEY) || "{}");
    return { model: saved.model || "", instructions: saved.instructions || "", max: saved.max || "", temperature: saved.temperature ?? "", turns: Array.isArray(saved.turns) ? saved.turns : [] };
  } catch {
    return { model: "", instructions: "", max: "", temperature: "", turns: [] };
  }
}

function save(store, state) {
  store.setItem(KEY, JSON.stringify(state));
}

// One output item as it streams: a message, a reasoning trace, a (custom) tool call.
function itemView(item) {
  if (item.type === "reasoning") {
    const text = h("pre", { class: "reasoning-text" });
    const el = h("details", { class: "item reasoning", open: true }, h("summary", {}, "Reasoning"), text);
    return { el, text, kind: "reasoning" };
  }
  if (item.type === "function_call" || item.type === "custom_tool_call") {
    const text = h("pre", { class: "tool-args" });
    const el = h("div", { class: "item tool-call" }, h("div", { class: "tool-name" }, `Tool call: ${item.name || "?"}`), text);
    return { el, text, kind: "tool" };
  }
  const text = h("div", { class: "answer-text" });
  return { el: h("div", { class: "item message" }, text), text, kind: "message" };
}

function itemText(item) {
  if (item.type === "reasoning") {
    return (item.content || []).map((c) => c.text || "").join("") || (item.summary || []).map((c) => c.text || "").join("");
  }
  if (item.type === "function_call") return item.arguments || "";
  if (item.type === "custom_tool_call") return item.input || "";
  return (item.content || []).filter((c) => c.type === "output_text" || c.type === "refusal").map((c) => c.text || c.refusal || "").join("");
}

function stats(turn) {
  const parts = [];
  if (turn.ttft_ms !== undefined && turn.ttft_ms !== null) parts.push(`TTFT ${Math.round(turn.ttft_ms)} ms`);
  if (turn.tps) parts.push(`${turn.tps.toFixed(1)} tok/s`);
  if (turn.tokens !== undefined) parts.push(`${turn.tokens} tokens`);
  return parts.join(" · ");
}

export function mount(main) {
  const store = storage(); // this page's owner's: a late write never lands in another's
  let mounted = true;
  const state = load(store);
  const remember = () => {
    if (mounted) save(store, state);
  };
  const controller = new AbortController();
  let running = null; // {id, stop: AbortController}

  const model = h("select", { id: "chat-model", name: "model" });
  const system = h("textarea", { id: "chat-system", name: "instructions", rows: 2, placeholder: "Optional" });
  const maxTokens = h("input", { id: "chat-max", name: "max_output_tokens", type: "number", min: 1, inputmode: "numeric", placeholder: "server default" });
  const temperature = h("input", { id: "chat-temperature", name: "temperature", type: "number", min: 0, max: 2, step: 0.1, inputmode: "decimal", placeholder: "model default" });
  const fresh = h("button", { type: "button", class: "secondary", id: "chat-new" }, "New chat");
  const transcript = h("ol", { class: "transcript", id: "transcript", "aria-label": "Conversation", "aria-live": "polite" });
  const prompt = h("textarea", { id: "chat-prompt", name: "prompt", rows: 3, required: true, placeholder: "Ask something… (Enter sends, Shift+Enter: new line)" });
  const send = h("button", { type: "submit", id: "chat-send" }, "Send");
  const stop = h("button", { type: "button", id: "chat-stop", class: "danger", disabled: true }, "Stop");
  const status = h("p", { class: "status", id: "chat-status", role: "status" });
  const composer = h("form", { class: "composer", "aria-label": "Send a message" }, field("Message", prompt), h("div", { class: "actions" }, fresh, send, stop));

  system.value = state.instructions;
  maxTokens.value = state.max;
  temperature.value = state.temperature;
  main.append(
    h("section", { class: "chat", "aria-labelledby": "chat-title" },
      h("h1", { id: "chat-title", class: "visually-hidden" }, "Chat"),
      h("details", { class: "card settings", open: !state.turns.length },
        h("summary", {}, "Settings"),
        h("div", { class: "settings-grid" }, field("Model", model), field("Temperature", temperature), field("Max output tokens", maxTokens), field("System prompt", system))),
      transcript, status, composer),
  );

  function settings() {
    state.model = model.value;
    state.instructions = system.value;
    state.max = maxTokens.value;
    state.temperature = temperature.value;
    remember();
  }
  model.addEventListener("change", settings);
  system.addEventListener("change", settings);
  maxTokens.addEventListener("change", settings);
  temperature.addEventListener("change", settings);

  function userTurn(text) {
    const li = h("li", { class: "turn user" }, h("div", { class: "who" }, "You"), h("div", { class: "user-text" }, text));
    transcript.append(li);
    return li;
  }

  function assistantTurn() {
    const items = h("div", { class: "items" });
    const meta = h("div", { class: "meta" });
    const li = h("li", { class: "turn assistant" }, h("div", { class: "who" }, "Model"), items, meta);
    transcript.append(li);
    return { li, items, meta, views: new Map() };
  }

  function renderFinal(view, output) {
    view.items.replaceChildren();
    view.views.clear();
    output.forEach((item, i) => {
      const v = itemView(item);
      v.text.textContent = itemText(item);
      view.views.set(i, v);
      view.items.append(v.el);
    });
  }

  async function restore() {
    for (const turn of state.turns) {
      const [response, inputs] = await Promise.all([
        api(`/v1/responses/${encodeURIComponent(turn.id)}`, { signal: controller.signal }),
        api(`/v1/responses/${encodeURIComponent(turn.id)}/input_items?order=asc&limit=100`, { signal: controller.signal }),
      ]);
      const said = inputs.data
        .filter((it) => it.type === "message" && it.role === "user")
        .map((it) => (typeof it.content === "string" ? it.content : (it.content || []).map((c) => c.text || "").join("")))
        .join("\n");
      userTurn(said);
      const view = assistantTurn();
      renderFinal(view, response.output || []);
      view.meta.textContent = [stats(turn), response.status === "cancelled" ? "stopped" : response.status === "completed" ? "" : response.status].filter(Boolean).join(" · ");
    }
    transcript.lastElementChild?.scrollIntoView({ block: "end" });
  }

  async function models() {
    const list = await api("/lmsp/v1/models", { signal: controller.signal });
    // Loaded first (the default model is loaded at start), then the others ready to load.
    const ready = list.data.filter((m) => m.ready).sort((a, b) => Number(b.loaded) - Number(a.loaded));
    model.replaceChildren(...ready.map((m) => h("option", { value: m.id }, m.loaded ? `${m.id} (loaded)` : m.id)));
    if (state.model && ready.some((m) => m.id === state.model)) model.value = state.model;
  }

  async function ask(text) {
    settings();
    const body = { model: model.value, input: text, stream: true, store: true };
    if (system.value.trim()) body.instructions = system.value;
    if (maxTokens.value) body.max_output_tokens = Number(maxTokens.value);
    if (temperature.value !== "") body.temperature = Number(temperature.value);
    const last = state.turns[state.turns.length - 1];
    if (last) body.previous_response_id = last.id;
    userTurn(text);
    const view = assistantTurn();
    view.meta.textContent = "waiting…";
    const abort = new AbortController();
    running = { id: null, abort };
    send.disabled = true;
    const started = performance.now();
    let first = null;
    let end = null;
    let final = null;
    try {
      const response = await check(await fetch("/v1/responses", {
        method: "POST",
        headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
        body: JSON.stringify(body),
        signal: abort.signal,
      }));
      for await (const frame of frames(response.body)) {
        if (frame.data === "[DONE]") break;
        const ev = JSON.parse(frame.data);
        if (ev.type === "response.created") {
          running.id = ev.response.id;
          stop.disabled = false;
          view.meta.textContent = "generating…";
        } else if (ev.type === "response.output_item.added") {
          const v = itemView(ev.item);
          view.views.set(ev.output_index, v);
          view.items.append(v.el);
        } else if (ev.type.endsWith(".delta") && typeof ev.delta === "string") {
          if (first === null) first = performance.now();
          const v = view.views.get(ev.output_index);
          if (v) v.text.textContent += ev.delta;
        } else if (ev.type === "response.output_item.done") {
          const v = view.views.get(ev.output_index);
          if (v) v.text.textContent = itemText(ev.item);
        } else if (ev.type === "response.completed" || ev.type === "response.incomplete" || ev.type === "response.failed") {
          end = performance.now();
          final = ev.response;
        } else if (ev.type === "error") {
          throw new Error(ev.message || "the stream failed");
        }
      }
    } catch (err) {
      view.meta.textContent = `error: ${errorText(err)}`;
      view.li.classList.add("failed");
    } finally {
      stop.disabled = true;
      send.disabled = false;
      running = null;
    }
    if (!final) return;
    const tokens = final.usage ? final.usage.output_tokens : undefined;
    const turn = { id: final.id };
    if (first !== null) turn.ttft_ms = first - started;
    if (first !== null && tokens > 1 && end > first) turn.tps = (tokens - 1) / ((end - first) / 1000);
    if (tokens !== undefined) turn.tokens = tokens;
    state.turns.push(turn);
    remember();
    const outcome = final.status === "cancelled" ? "stopped" : final.status === "completed" ? "" : final.status;
    view.meta.textContent = [stats(turn), outcome].filter(Boolean).join(" · ");
    view.li.dataset.status = final.status;
    if (final.error) view.meta.textContent += ` · ${final.error.message}`;
  }

  composer.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = prompt.value.trim();
    if (!text || running) return;
    prompt.value = "";
    ask(text).finally(() => prompt.focus());
  });
  prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      composer.requestSubmit();
    }
  });
  stop.addEventListener("click", async () => {
    if (!running || !running.id) return;
    stop.disabled = true;
    try {
      await api(`/v1/responses/${encodeURIComponent(running.id)}/cancel`, { method: "POST" });
    } catch (err) {
      status.textContent = `Stop failed: ${errorText(err)}`;
    }
  });
  fresh.addEventListener("click", () => {
    state.turns = [];
    remember();
    transcript.replaceChildren();
    status.textContent = "";
    prompt.focus();
  });

  models()
    .then(restore)
    .catch((err) => {
      if (err.name === "AbortError") return;
      if (err instanceof ApiError && err.status < 500) {
        // A turn this server (or this token) no longer has: start afresh rather than chain to it.
        state.turns = [];
        remember();
        transcript.replaceChildren();
      }
      status.textContent = errorText(err);
    });

  return () => {
    mounted = false;
    controller.abort();
    running?.abort.abort();
  };
}
