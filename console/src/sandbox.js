// One sandbox: its state and actions, a CPU and memory chart, a terminal
// and a file browser.

import * as api from "./api.js";
import { el, fill, bytes } from "./dom.js";
import { attempt, report, every, countdown, tickCountdown, stateCell, resources, sandboxActions } from "./app.js";
import { openTerminal } from "./terminal.js";
import { drawChart } from "./chart.js";

/** The daemon samples a sandbox every five seconds. */
const METRICS_MS = 5000;

export function sandboxView(root, id) {
  const path = (rest) => api.sandboxPath(id, rest);
  const summary = el("tbody");
  const canvas = el("canvas", { class: "chart", id: "usage-chart", width: 900, height: 160 });
  const legend = el("div", { class: "legend" });
  const termBox = el("div", { class: "terminal", id: "terminal", hidden: true });
  const termButton = el("button", { type: "button", id: "open-terminal", class: "primary" }, "Open terminal");
  const files = fileBrowser(id);
  let terminal = null;
  let sandbox = null;

  termButton.addEventListener("click", () => {
    terminal?.close();
    termBox.hidden = false;
    terminal = openTerminal(termBox, path("/pty"));
  });

  fill(root,
    el("p", {}, el("a", { href: "#/sandboxes" }, "← sandboxes")),
    el("section", {}, el("h2", {}, "Sandbox ", el("span", { class: "mono" }, id)),
      el("table", { id: "sandbox" }, summary)),
    el("section", {}, el("h2", {}, "CPU and memory"), legend, canvas),
    el("section", {}, el("h2", {}, "Terminal"), termButton, termBox),
    files.node);

  const load = async () => {
    let sb;
    try {
      sb = await api.get(path());
    } catch (e) {
      if (e.code === "not_found") { fill(summary, el("tr", {}, el("td", { class: "error" }, "No such sandbox."))); return; }
      throw e;
    }
    const first = sandbox === null;
    sandbox = sb;
    const row = (k, ...v) => el("tr", {}, el("th", {}, k), ...v);
    fill(summary,
      row("state", stateCell(sb.state)),
      row("template", el("td", {}, sb.template)),
      row("resources", el("td", {}, resources(sb))),
      row("created", el("td", {}, sb.created_at)),
      row("time left", countdown(sb.expires_at, sb.state)),
      sb.last_error_code && row("last error", el("td", { class: "error" }, sb.last_error_code)),
      row("", el("td", {}, sandboxActions(sb, load),
        sb.state === "running" && el("button", { type: "button", onclick: () => attempt(async () => {
          const s = await api.post(path("/snapshots"), {});
          alertInfo(`Snapshot ${s.id} taken.`);
        }) }, "snapshot"),
        // A grant for an end user: this sandbox's exec, files and terminal
        // for an hour (docs/api.md, "Grants to end users").
        sb.state === "running" && el("button", { type: "button", id: "share", onclick: () => attempt(async () => {
          const g = await api.post(path("/grants"), { scopes: ["exec", "files:read", "files:write", "pty"], ttl_seconds: 3600 });
          alertInfo(`Grant for ${g.scopes.join(", ")} until ${g.expires_at} (shown once): ${g.token}`);
        }) }, "share"))));
    termButton.disabled = sb.state !== "running";
    if (first && sb.state === "running") files.refresh().catch(report);
  };

  const series = { cpu: [], mem: [] };
  const loadMetrics = async () => {
    // An ended sandbox has no samples left to show.
    if (sandbox && ["terminated", "terminating", "lost"].includes(sandbox.state)) return;
    const m = await api.get(path("/metrics"));
    series.cpu = m.samples.map((s) => [Date.parse(s.at), s.cpu_used_pct]);
    series.mem = m.samples.map((s) => [Date.parse(s.at), s.mem_total_bytes ? (100 * s.mem_used_bytes) / s.mem_total_bytes : 0]);
    const last = m.samples[m.samples.length - 1];
    fill(legend,
      el("span", { class: "cpu" }, `CPU ${last ? last.cpu_used_pct.toFixed(1) : "–"}% of ${last ? last.cpu_count : "?"}`),
      el("span", { class: "mem" }, `memory ${last ? `${bytes(last.mem_used_bytes)} of ${bytes(last.mem_total_bytes)}` : "–"}`),
      el("span", { class: "muted", id: "sample-count" }, `${m.samples.length} samples`));
    drawChart(canvas, [{ points: series.cpu, color: "#2557a7" }, { points: series.mem, color: "#b35c00" }]);
  };

  const stopLoad = every(2000, load);
  const stopMetrics = every(METRICS_MS, loadMetrics);
  const clock = setInterval(() => { for (const c of summary.querySelectorAll("td.time-left")) tickCountdown(c); }, 1000);
  return () => { stopLoad(); stopMetrics(); clearInterval(clock); terminal?.close(); };
}

function alertInfo(text) {
  const n = document.getElementById("notice");
  n.textContent = text;
  n.className = "info";
  n.hidden = false;
}

/** A directory listing of the sandbox with upload and download. */
function fileBrowser(id) {
  const path = (rest) => api.sandboxPath(id, rest);
  const dir = el("input", { id: "files-path", value: "/workspace", size: 40 });
  const body = el("tbody");
  const upload = el("input", { type: "file", id: "upload", multiple: true });
  const status = el("span", { class: "muted", id: "files-status" });

  const join = (d, name) => (d.endsWith("/") ? d + name : `${d}/${name}`);
  const refresh = async () => {
    const d = dir.value;
    const list = await api.get(api.withQuery(path("/files/list"), { path: d, recursive: false, limit: 1000 }));
    const up = d.replace(/\/[^/]*\/?$/, "") || "/";
    fill(body,
      d !== "/" && el("tr", {}, el("td", {}, el("a", { href: "", onclick: (ev) => { ev.preventDefault(); dir.value = up; attempt(refresh); } }, "..")), el("td"), el("td"), el("td")),
      list.entries.map((e) => {
        const full = join(d, e.path);
        const name = e.type === "directory"
          ? el("a", { href: "", onclick: (ev) => { ev.preventDefault(); dir.value = full; attempt(refresh); } }, e.path + "/")
          : e.path;
        return el("tr", { "data-path": e.path },
          el("td", { class: "mono" }, name), el("td", {}, e.type), el("td", { class: "num" }, e.type === "file" ? bytes(e.size) : ""),
          el("td", {}, e.type === "file" && el("button", { type: "button", "data-download": e.path, onclick: () => attempt(() => download(full, e.path)) }, "download")));
      }));
    status.textContent = list.next_cursor ? "(first 1000 entries)" : "";
  };

  const download = async (full, name) => {
    const resp = await api.request("GET", api.withQuery(path("/files"), { path: full }));
    const url = URL.createObjectURL(await resp.blob());
    const a = el("a", { href: url, download: name.split("/").pop() });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  };

  upload.addEventListener("change", () => attempt(async () => {
    for (const f of upload.files) {
      status.textContent = `uploading ${f.name}…`;
      await api.request("PUT", api.withQuery(path("/files"), { path: join(dir.value, f.name) }), {
        body: f, headers: { "Content-Type": "application/octet-stream" },
      });
    }
    upload.value = "";
    status.textContent = "uploaded";
    await refresh();
  }));

  const form = el("form", { class: "inline" }, el("label", { for: "files-path" }, "Directory"), dir,
    el("button", { type: "submit" }, "List"), el("label", { for: "upload" }, "Upload"), upload, status);
  form.addEventListener("submit", (ev) => { ev.preventDefault(); attempt(refresh); });
  const node = el("section", { id: "files" }, el("h2", {}, "Files"), form,
    el("table", {}, el("thead", {}, el("tr", {}, ["name", "type", "size", ""].map((h) => el("th", {}, h)))), body));
  return { node, refresh };
}
