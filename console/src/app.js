// The console's shell: sign-in, navigation (the URL's hash names the view)
// and the list views: sandboxes, templates with their builds, snapshots,
// volumes.

import * as api from "./api.js";
import { el, fill, bytes, duration, secondsUntil } from "./dom.js";
import { sandboxView } from "./sandbox.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const notice = document.getElementById("notice");
const who = document.getElementById("who");
const signOutButton = document.getElementById("sign-out");

/** How often lists are read again while shown, in milliseconds. */
export const POLL_MS = 2000;

/** The cleanup of the view shown (its timers and streams). */
let leave = () => {};

/** Shows an error above the view (or clears it). */
export function report(err) {
  if (!err) { notice.hidden = true; notice.textContent = ""; return; }
  if (err.name === "AbortError") return;
  notice.textContent = String(err);
  notice.className = "";
  notice.hidden = false;
}

/** Runs `f`, reporting its error; for buttons. */
export async function attempt(f) {
  report(null);
  try { await f(); } catch (e) { report(e); }
}

/** Calls `f` now and every `ms` until the view is left; returns a stop. */
export function every(ms, f) {
  let stopped = false, timer;
  const tick = async () => {
    try { await f(); } catch (e) { report(e); }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

function signOut(message) {
  api.key.clear();
  leave();
  leave = () => {};
  showSignIn(message);
}

function showSignIn(message) {
  nav.hidden = true;
  signOutButton.hidden = true;
  who.textContent = "";
  report(null);
  const input = el("input", { id: "api-key", type: "password", autocomplete: "off", placeholder: "hutch_…", required: true });
  const error = el("p", { id: "sign-in-error", class: "error", role: "alert" }, message || "");
  const form = el("form", { class: "signin", id: "sign-in" },
    el("h2", {}, "Sign in"),
    el("label", { for: "api-key" }, "API key"),
    input,
    el("p", { class: "muted" }, "The key stays in this tab (session storage) and is sent only in the Authorization header."),
    el("button", { class: "primary", type: "submit" }, "Sign in"),
    error);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const k = input.value.trim();
    error.textContent = "";
    try {
      const usage = await api.get("/v1/usage", { key: k });
      api.key.set(k);
      signedIn(usage);
    } catch (e) {
      error.textContent = e.status === 401 ? "This API key was refused." : String(e);
    }
  });
  fill(main, form);
  input.focus();
}

function signedIn(usage) {
  nav.hidden = false;
  signOutButton.hidden = false;
  who.textContent = `key ${usage.key_id}`;
  if (!location.hash || location.hash === "#") location.hash = "#/sandboxes"; // routes on hashchange
  else route();
}

function route() {
  if (!api.key.get()) return;
  leave();
  report(null);
  const [, view, arg] = location.hash.split("/");
  for (const a of nav.querySelectorAll("a")) a.classList.toggle("current", a.getAttribute("href") === `#/${view}`);
  const views = {
    sandboxes: sandboxesView, sandbox: sandboxView, templates: templatesView, snapshots: snapshotsView,
    volumes: volumesView,
  };
  const show = views[view] || sandboxesView;
  leave = show(main, arg ? decodeURIComponent(arg) : undefined) || (() => {});
}

// ---------------------------------------------------------------------------
// Sandboxes

/** Time-left cells, refreshed every second from their sandbox's expiry. */
export function countdown(expiresAt, state) {
  const cell = el("td", { class: "num time-left", "data-expires": expiresAt, "data-state": state });
  tickCountdown(cell);
  return cell;
}

export function tickCountdown(cell) {
  const state = cell.dataset.state;
  if (state === "terminated" || state === "terminating" || state === "lost") { cell.textContent = "—"; return; }
  const left = secondsUntil(cell.dataset.expires);
  cell.textContent = left > 0 ? duration(left) : "expiring";
}

export function stateCell(state) {
  return el("td", { class: `state state-${state}` }, state);
}

export function resources(sb) {
  return `${sb.limits.vcpus} CPU · ${sb.memory_mb} MiB · ${sb.limits.disk_mib} MiB disk`;
}

/** The buttons that change a sandbox; `after` runs once one succeeded. */
export function sandboxActions(sb, after) {
  const path = (rest) => api.sandboxPath(sb.id, rest);
  const act = (label, f, cls) =>
    el("button", { type: "button", class: cls, "data-action": label, onclick: () => attempt(async () => { await f(); await after(); }) }, label);
  const live = sb.state !== "terminated" && sb.state !== "terminating" && sb.state !== "lost";
  return el("span", { class: "actions" },
    live && act("+10m", () => api.post(path("/extend"), { by: 600 })),
    sb.state === "running" && act("suspend", () => api.post(path("/suspend"), {})),
    (sb.state === "suspended" || sb.state === "paused") && act("resume", () => api.post(path("/resume"), {})),
    live && act("delete", () => api.del(path()), "danger"));
}

function sandboxesView(root) {
  const body = el("tbody");
  const templates = el("select", { id: "create-template" }, el("option", { value: "base" }, "base"));
  const ttl = el("input", { id: "create-ttl", type: "number", min: 1, value: 10, size: 4 });
  const create = el("form", { class: "inline", id: "create-sandbox" },
    el("label", { for: "create-template" }, "Template"), templates,
    el("label", { for: "create-ttl" }, "Minutes"), ttl,
    el("button", { class: "primary", type: "submit" }, "Create sandbox"));
  create.addEventListener("submit", (ev) => {
    ev.preventDefault();
    attempt(async () => {
      const button = create.querySelector("button");
      button.disabled = true;
      try {
        const sb = await api.post("/v1/sandboxes", { template: templates.value, ttl_seconds: Number(ttl.value) * 60 },
          { headers: { "Idempotency-Key": crypto.randomUUID() } });
        location.hash = `#/sandbox/${encodeURIComponent(sb.id)}`;
      } finally {
        button.disabled = false;
      }
    });
  });
  api.get("/v1/templates").then((list) => {
    for (const t of list.templates) templates.append(el("option", { value: t.name }, t.name));
  }).catch(report);

  fill(root,
    el("section", {}, el("h2", {}, "New sandbox"), create),
    el("section", {}, el("h2", {}, "Sandboxes"),
      el("table", { id: "sandboxes" },
        el("thead", {}, el("tr", {}, ["id", "state", "template", "resources", "time left", ""].map((h) => el("th", {}, h)))),
        body)));

  const load = async () => {
    const list = await api.get(api.withQuery("/v1/sandboxes", { live: true, limit: 200 }));
    fill(body, list.sandboxes.map((sb) => el("tr", { "data-id": sb.id },
      el("td", {}, el("a", { href: `#/sandbox/${encodeURIComponent(sb.id)}`, class: "mono" }, sb.id)),
      stateCell(sb.state),
      el("td", {}, sb.template),
      el("td", {}, resources(sb)),
      countdown(sb.expires_at, sb.state),
      el("td", {}, sandboxActions(sb, load)))));
    if (!list.sandboxes.length) body.append(el("tr", {}, el("td", { colspan: 6, class: "muted" }, "No live sandboxes.")));
  };
  const stopPoll = every(POLL_MS, load);
  const clock = setInterval(() => {
    for (const c of body.querySelectorAll("td.time-left")) tickCountdown(c);
  }, 1000);
  return () => { stopPoll(); clearInterval(clock); };
}

// ---------------------------------------------------------------------------
// Templates, their builds and build logs

function templatesView(root) {
  const body = el("tbody");
  const builds = el("section", { id: "builds", hidden: true });
  let logStream = null;
  fill(root,
    el("section", {}, el("h2", {}, "Templates"),
      el("table", { id: "templates" },
        el("thead", {}, el("tr", {}, ["name", "id", "version", "image", "resources", "warm", ""].map((h) => el("th", {}, h)))),
        body)),
    builds);

  const showLog = (t, b) => {
    logStream?.abort();
    logStream = new AbortController();
    const pre = el("pre", { class: "log", id: "build-log" });
    const old = builds.querySelector(".log-box");
    const box = el("div", { class: "log-box" }, el("h2", {}, `Log of ${b.id}`), pre);
    old ? old.replaceWith(box) : builds.append(box);
    followLog(api.withQuery(`/v1/templates/${encodeURIComponent(t.id)}/builds/${encodeURIComponent(b.id)}/logs`, { follow: true }),
      pre, logStream.signal).catch(report);
  };

  const showBuilds = async (t) => {
    const list = await api.get(`/v1/templates/${encodeURIComponent(t.id)}/builds`);
    builds.hidden = false;
    fill(builds, el("h2", {}, `Builds of ${t.name}`),
      list.builds.length === 0 ? el("p", { class: "muted" }, "No builds.") :
        el("table", {}, el("thead", {}, el("tr", {}, ["id", "state", "created", "finished", "version", "error", ""].map((h) => el("th", {}, h)))),
          el("tbody", {}, list.builds.map((b) => el("tr", {},
            el("td", { class: "mono" }, b.id), el("td", {}, b.state), el("td", {}, b.created_at),
            el("td", {}, b.finished_at || ""), el("td", {}, b.version ?? ""), el("td", { class: "error" }, b.error || ""),
            el("td", {}, el("button", { type: "button", onclick: () => showLog(t, b) }, "log")))))));
  };

  api.get("/v1/templates").then((list) => {
    fill(body, list.templates.map((t) => el("tr", {},
      el("td", {}, t.name), el("td", { class: "mono" }, t.id), el("td", { class: "num" }, t.version),
      el("td", {}, t.image),
      el("td", {}, `${t.limits.vcpus ?? "?"} CPU · ${t.memory_mb} MiB`),
      el("td", { class: "num" }, `${t.warm_ready}/${t.warm.max}`),
      el("td", {}, el("button", { type: "button", onclick: () => attempt(() => showBuilds(t)) }, "builds")))));
    if (!list.templates.length) body.append(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No templates of this key; sandboxes can use base.")));
  }).catch(report);
  return () => logStream?.abort();
}

/** Streams a text answer into `pre` as it arrives (a build's log). */
async function followLog(path, pre, signal) {
  const resp = await api.request("GET", path, { signal });
  const reader = resp.body.getReader();
  const text = new TextDecoder();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    pre.append(text.decode(value, { stream: true }));
    pre.scrollTop = pre.scrollHeight;
  }
  pre.append(el("span", { class: "muted" }, "\n(end of log)"));
}

// ---------------------------------------------------------------------------
// Snapshots

function snapshotsView(root) {
  const body = el("tbody");
  fill(root, el("section", {}, el("h2", {}, "Snapshots"),
    el("table", { id: "snapshots" },
      el("thead", {}, el("tr", {}, ["id", "name", "of sandbox", "size", "created", ""].map((h) => el("th", {}, h)))),
      body)));
  const load = async () => {
    const list = await api.get("/v1/snapshots");
    fill(body, list.snapshots.map((s) => el("tr", {},
      el("td", { class: "mono" }, s.id), el("td", {}, s.name || ""), el("td", { class: "mono" }, s.sandbox_id),
      el("td", { class: "num" }, bytes(s.size_bytes)), el("td", {}, s.created_at),
      el("td", { class: "actions" },
        el("button", { type: "button", onclick: () => attempt(async () => {
          const sb = await api.post("/v1/sandboxes", { snapshot: s.id }, { headers: { "Idempotency-Key": crypto.randomUUID() } });
          location.hash = `#/sandbox/${encodeURIComponent(sb.id)}`;
        }) }, "start sandbox"),
        el("button", { type: "button", class: "danger", onclick: () => attempt(async () => { await api.del(`/v1/snapshots/${encodeURIComponent(s.id)}`); await load(); }) }, "delete")))));
    if (!list.snapshots.length) body.append(el("tr", {}, el("td", { colspan: 6, class: "muted" }, "No snapshots.")));
  };
  load().catch(report);
}

// ---------------------------------------------------------------------------
// Volumes: made here, mounted by sandboxes at their creation (the API's
// `volumes`), grown (never shrunk) and deleted when no sandbox mounts them.

function volumesView(root) {
  const body = el("tbody");
  const name = el("input", { id: "volume-name", required: true, pattern: "[a-z0-9][a-z0-9._\\-]{0,62}", placeholder: "data", size: 16 });
  const size = el("input", { id: "volume-size", type: "number", min: 1, value: 1024, size: 7 });
  const create = el("form", { class: "inline", id: "create-volume" },
    el("label", { for: "volume-name" }, "Name"), name,
    el("label", { for: "volume-size" }, "MiB"), size,
    el("button", { class: "primary", type: "submit" }, "Create volume"));
  fill(root,
    el("section", {}, el("h2", {}, "New volume"), create),
    el("section", {}, el("h2", {}, "Volumes"),
      el("table", { id: "volumes" },
        el("thead", {}, el("tr", {}, ["name", "id", "size", "used", "mounted by", "created", ""].map((h) => el("th", {}, h)))),
        body)));
  const volumePath = (v) => `/v1/volumes/${encodeURIComponent(v.id)}`;
  const load = async () => {
    const list = await api.get("/v1/volumes");
    fill(body, list.volumes.map((v) => el("tr", { "data-id": v.id },
      el("td", {}, v.name), el("td", { class: "mono" }, v.id),
      el("td", { class: "num" }, bytes(v.size_mib * 1048576)), el("td", { class: "num" }, bytes(v.used_bytes)),
      el("td", {}, ...v.mounted_by.map((m) => el("div", {},
        el("a", { href: `#/sandbox/${encodeURIComponent(m.sandbox_id)}`, class: "mono" }, m.sandbox_id),
        ` at ${m.path}${m.read_only ? " (read-only)" : ""}`))),
      el("td", {}, v.created_at),
      el("td", { class: "actions" },
        el("button", { type: "button", "data-action": "grow", onclick: () => attempt(async () => {
          await api.patch(volumePath(v), { size_mib: v.size_mib * 2 });
          await load();
        }) }, "double size"),
        el("button", { type: "button", class: "danger", "data-action": "delete", onclick: () => attempt(async () => {
          await api.del(volumePath(v));
          await load();
        }) }, "delete")))));
    if (!list.volumes.length) body.append(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No volumes.")));
  };
  create.addEventListener("submit", (ev) => {
    ev.preventDefault();
    attempt(async () => {
      await api.post("/v1/volumes", { name: name.value, size_mib: Number(size.value) });
      name.value = "";
      await load();
    });
  });
  return every(POLL_MS, load);
}

// ---------------------------------------------------------------------------

api.whenUnauthorized(() => signOut("The key was refused; sign in again."));
signOutButton.addEventListener("click", () => signOut());
window.addEventListener("hashchange", route);

if (api.key.get()) {
  api.get("/v1/usage").then(signedIn).catch((e) => signOut(String(e)));
} else {
  showSignIn();
}
