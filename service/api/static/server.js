// Server: version, readiness, the models (loaded, size, idle-unload countdown; a split model's
// part on each host), the caller's queue by status, the engine (its group of hosts), the recent
// speed: GET /lmsp/v1/summary, read every 2 s.

import { api } from "./api.js";
import { bytes, duration, errorText, h } from "./dom.js";

const STATUSES = ["queued", "loading", "running", "cancelling", "succeeded", "failed", "cancelled"];

export function mount(main) {
  const controller = new AbortController();
  const overview = h("dl", { class: "facts", id: "server-overview" });
  const models = h("tbody", { id: "server-models" });
  const queue = h("dl", { class: "counts", id: "server-queue" });
  const engine = h("dl", { class: "facts", id: "server-engine" });
  const speed = h("dl", { class: "facts", id: "server-speed" });
  const line = h("p", { class: "status", role: "status", id: "server-status" });
  main.append(
    h("section", { "aria-labelledby": "server-title" },
      h("h1", { id: "server-title" }, "Server"),
      line,
      h("div", { class: "grid" },
        h("div", { class: "card" }, h("h2", {}, "Overview"), overview),
        h("div", { class: "card" }, h("h2", {}, "Your queue"), queue),
        h("div", { class: "card" }, h("h2", {}, "Engine"), engine),
        h("div", { class: "card" }, h("h2", {}, "Recent speed"), speed)),
      h("div", { class: "card" }, h("h2", {}, "Models"),
        h("div", { class: "table-wrap" },
          h("table", {},
            h("thead", {}, h("tr", {}, ...["Model", "State", "Size", "Weights", "Running", "Unloads"].map((c) => h("th", { scope: "col" }, c)))),
            models)))),
  );

  let last = null; // the last summary, and when (this clock) it came
  function facts(list, pairs) {
    list.replaceChildren(...pairs.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  }

  function countdown(m) {
    if (!m.loaded) return "–";
    if (m.pinned) return "pinned";
    if (m.running) return "in use";
    if (m.unload_at === null) return "not due";
    const now = last.summary.now + (performance.now() - last.at) / 1000;
    return `in ${duration(m.unload_at - now)}`;
  }

  function render() {
    const s = last.summary;
    facts(overview, [["Version", s.version], ["Health", s.ready ? "ready" : "not ready"], ["Server time", new Date(s.now * 1000).toLocaleTimeString()]]);
    facts(queue, STATUSES.map((k) => [k, String(s.tasks[k])]));
    const group = s.engine.hosts
      ? [["Hosts", s.engine.hosts.map((g) => `rank ${g.rank} ${g.host} (${bytes(g.memory_bytes)})`).join(", ")],
         ["Link", `${bytes(s.engine.hosts[0].link_bytes_per_sec)}/s`]]
      : [];
    facts(engine, [["State", s.engine.state], ["PID", s.engine.pid ?? "–"], ["Memory (RSS)", bytes(s.engine.rss_bytes)], ["Generating", String(s.engine.in_flight)], ["Up for", duration(s.engine.uptime_secs)], ...group]);
    facts(speed, [
      ["TTFT (median)", s.speed.ttft_ms === null ? "–" : `${s.speed.ttft_ms} ms`],
      ["Tokens/s", s.speed.tokens_per_sec === null ? "–" : String(s.speed.tokens_per_sec)],
      ["Generations", `the last ${s.speed.generations}`],
    ]);
    models.replaceChildren(...s.models.map((m) => h("tr", {},
      h("th", { scope: "row" }, m.id),
      h("td", {}, m.loaded ? "loaded" : m.ready ? "on disk" : "not pulled"),
      h("td", {}, !m.loaded ? "–" : m.hosts
        ? m.hosts.map((g) => `${bytes(g.resident_bytes)} on rank ${g.rank} (layers ${g.layers[0]}–${g.layers[1] - 1})`).join(", ")
        : bytes(m.resident_bytes)),
      h("td", {}, m.weight_dtype || "–"),
      h("td", {}, String(m.running)),
      h("td", { class: "countdown" }, countdown(m)))));
  }

  async function refresh() {
    try {
      last = { summary: await api("/lmsp/v1/summary", { signal: controller.signal }), at: performance.now() };
      line.textContent = "";
      render();
    } catch (err) {
      if (err.name !== "AbortError") line.textContent = `Server unreachable: ${errorText(err)}`;
    }
  }

  refresh();
  const poll = setInterval(refresh, 2000);
  const tick = setInterval(() => { if (last) render(); }, 1000);
  return () => { controller.abort(); clearInterval(poll); clearInterval(tick); };
}
