// Tasks: the caller's LMSP tasks, newest first (GET /lmsp/v1/tasks: status filter, pages by
// `after`), a form to submit one, and a task's page following its event stream live
// (api.followTask: reconnects with Last-Event-ID, so a server restart shows "reconnecting",
// then the resumed text, then the final state).

import { api, ApiError, followTask } from "./api.js";
import { errorText, field, h, when } from "./dom.js";

const STATUSES = ["queued", "loading", "running", "cancelling", "succeeded", "failed", "cancelled"];
const PAGE = 20;

export function mount(main, taskId) {
  return taskId ? mountTask(main, taskId) : mountList(main);
}

function outputText(response) {
  return (response?.output || []).filter((i) => i.type === "message")
    .flatMap((i) => i.content || []).filter((c) => c.type === "output_text").map((c) => c.text).join("");
}

function badge(status) {
  return h("span", { class: `badge status-${status}` }, status);
}

function mountList(main) {
  const controller = new AbortController();
  const filter = h("select", { id: "tasks-status", name: "status" }, h("option", { value: "" }, "any"), ...STATUSES.map((s) => h("option", { value: s }, s)));
  const rows = h("tbody", { id: "tasks-rows" });
  const more = h("button", { type: "button", class: "secondary", id: "tasks-more", hidden: true }, "Older tasks");
  const listStatus = h("p", { class: "status", role: "status", id: "tasks-status-line" });
  let after = null;

  const prompt = h("textarea", { id: "task-prompt", name: "prompt", rows: 3, required: true });
  const model = h("select", { id: "task-model", name: "model" });
  const policy = h("select", { id: "task-on-restart", name: "on_restart" },
    h("option", { value: "fail" }, "fail"), h("option", { value: "retry" }, "retry"), h("option", { value: "resume" }, "resume"));
  const maxTokens = h("input", { id: "task-max", name: "max_output_tokens", type: "number", min: 1, inputmode: "numeric", placeholder: "server default" });
  const submitStatus = h("p", { class: "status", role: "status" });
  const form = h("form", { class: "card", "aria-labelledby": "submit-title" },
    h("h2", { id: "submit-title" }, "Submit a task"),
    field("Prompt", prompt),
    h("div", { class: "settings-grid" },
      field("Model", model),
      field("On restart", policy, "resume: continue from the committed tokens after a restart"),
      field("Max output tokens", maxTokens)),
    h("button", { type: "submit", id: "task-submit" }, "Submit"), submitStatus);

  main.append(
    h("section", { "aria-labelledby": "tasks-title" },
      h("div", { class: "page-head" }, h("h1", { id: "tasks-title" }, "Tasks"), field("Status", filter)),
      h("div", { class: "table-wrap" },
        h("table", { class: "tasks" },
          h("caption", { class: "visually-hidden" }, "Your tasks, newest first"),
          h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Task"), h("th", { scope: "col" }, "Status"), h("th", { scope: "col" }, "On restart"), h("th", { scope: "col" }, "Created"))),
          rows)),
      listStatus, more),
    form,
  );

  async function page(reset) {
    if (reset) { after = null; rows.replaceChildren(); }
    const q = new URLSearchParams({ limit: String(PAGE) });
    if (filter.value) q.append("status", filter.value);
    if (after) q.set("after", after);
    try {
      const list = await api(`/lmsp/v1/tasks?${q}`, { signal: controller.signal });
      for (const t of list.data) {
        rows.append(h("tr", {},
          h("td", {}, h("a", { href: `#/tasks/${t.id}` }, t.id)),
          h("td", {}, badge(t.status)),
          h("td", {}, t.on_restart),
          h("td", {}, when(t.created_at))));
      }
      after = list.last_id;
      more.hidden = !list.has_more;
      listStatus.textContent = rows.childElementCount ? "" : "No tasks yet.";
    } catch (err) {
      if (err.name !== "AbortError") listStatus.textContent = errorText(err);
    }
  }

  filter.addEventListener("change", () => page(true));
  more.addEventListener("click", () => page(false));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const input = { model: model.value, input: prompt.value };
    if (maxTokens.value) input.max_output_tokens = Number(maxTokens.value);
    try {
      const task = await api("/lmsp/v1/tasks", { method: "POST", body: { type: "response", on_restart: policy.value, input } });
      location.hash = `#/tasks/${task.id}`;
    } catch (err) {
      submitStatus.textContent = errorText(err);
    }
  });

  api("/lmsp/v1/models", { signal: controller.signal })
    .then((list) => model.replaceChildren(...list.data.filter((m) => m.ready).sort((a, b) => Number(b.loaded) - Number(a.loaded)).map((m) => h("option", { value: m.id }, m.id))))
    .catch((err) => { if (err.name !== "AbortError") submitStatus.textContent = errorText(err); });
  page(true);
  return () => controller.abort();
}

function mountTask(main, taskId) {
  const controller = new AbortController();
  const status = h("span", { id: "task-status" }, badge("…"));
  const connection = h("p", { class: "connection", id: "task-connection", role: "status" }, "connecting…");
  const text = h("div", { class: "answer-text", id: "task-text" });
  const reasoning = h("pre", { class: "reasoning-text", id: "task-reasoning" });
  const reasoningBox = h("details", { class: "item reasoning", hidden: true }, h("summary", {}, "Reasoning"), reasoning);
  const detail = h("dl", { class: "facts" });
  const error = h("p", { class: "error", role: "alert", id: "task-error" });
  const cancel = h("button", { type: "button", class: "danger", id: "task-cancel", disabled: true }, "Cancel");
  main.append(
    h("section", { "aria-labelledby": "task-title" },
      h("p", {}, h("a", { href: "#/tasks" }, "← All tasks")),
      h("div", { class: "page-head" }, h("h1", { id: "task-title" }, taskId), status, cancel),
      connection, detail, reasoningBox,
      h("div", { class: "card output", "aria-label": "Output", "aria-live": "off" }, text),
      error),
  );

  function show(task) {
    status.replaceChildren(badge(task.status));
    detail.replaceChildren(
      h("dt", {}, "On restart"), h("dd", {}, task.on_restart),
      h("dt", {}, "Attempt"), h("dd", {}, String(task.attempt)),
      h("dt", {}, "Created"), h("dd", {}, when(task.created_at)),
      h("dt", {}, "Response"), h("dd", {}, task.response_id));
    cancel.disabled = ["succeeded", "failed", "cancelled", "cancelling"].includes(task.status);
    if (task.error) error.textContent = `${task.error.title || "failed"}: ${task.error.detail || ""}`;
  }

  function onEvent(ev) {
    if (ev.type === "lmsp.attempt.restarted") { // a retry starts over: discard the earlier attempt's text
      text.textContent = "";
      reasoning.textContent = "";
    } else if (ev.type === "response.output_text.delta") {
      text.textContent += ev.delta;
    } else if (ev.type === "response.reasoning_text.delta") {
      reasoningBox.hidden = false;
      reasoning.textContent += ev.delta;
    } else if (ev.type === "response.in_progress") {
      status.replaceChildren(badge("running"));
    }
  }

  async function run() {
    try {
      show(await api(`/lmsp/v1/tasks/${encodeURIComponent(taskId)}`, { signal: controller.signal }));
      const final = await followTask(taskId, {
        signal: controller.signal,
        onEvent,
        onState: (s) => {
          connection.textContent = s === "live" ? "live" : "reconnecting…";
          connection.dataset.state = s;
        },
      });
      if (!final) return;
      connection.textContent = "finished";
      connection.dataset.state = "finished";
      const task = await api(`/lmsp/v1/tasks/${encodeURIComponent(taskId)}`, { signal: controller.signal });
      show(task);
    } catch (err) {
      if (err.name === "AbortError") return;
      connection.textContent = "";
      error.textContent = errorText(err);
      if (err instanceof ApiError && err.status === 410) { // events past retention: the final text as stored
        const task = await api(`/lmsp/v1/tasks/${encodeURIComponent(taskId)}`).catch(() => null);
        if (task) { show(task); text.textContent = outputText(task.response); }
      }
    }
  }

  cancel.addEventListener("click", async () => {
    cancel.disabled = true;
    try {
      show(await api(`/lmsp/v1/tasks/${encodeURIComponent(taskId)}/cancel`, { method: "POST" }));
    } catch (err) {
      error.textContent = errorText(err);
    }
  });
  run();
  return () => controller.abort();
}
