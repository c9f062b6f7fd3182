// The native API, as the console calls it. The key lives in this tab's
// sessionStorage only (gone when the tab closes) and is sent only in the
// Authorization header, never in a URL.

const KEY = "hutch.key";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
  toString() { return `${this.message} (${this.code})`; }
}

export const key = {
  get: () => sessionStorage.getItem(KEY),
  set: (k) => sessionStorage.setItem(KEY, k),
  clear: () => sessionStorage.removeItem(KEY),
};

/** Signs out when any call finds the key refused. */
let onUnauthorized = () => {};
export function whenUnauthorized(f) { onUnauthorized = f; }

/** A request; `opts.json` is sent as a JSON body, `opts.body` as is.
 *  Resolves to the Response (ok), or throws ApiError. */
export async function request(method, path, opts = {}) {
  const headers = { Authorization: `Bearer ${opts.key ?? key.get() ?? ""}`, ...(opts.headers || {}) };
  let body = opts.body;
  if (opts.json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(opts.json);
  }
  let resp;
  try {
    resp = await fetch(path, { method, headers, body, cache: "no-store", signal: opts.signal });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, "network", `the daemon did not answer: ${e.message}`);
  }
  if (resp.ok) return resp;
  let code = "http_" + resp.status, message = resp.statusText || "request failed";
  try {
    const b = await resp.json();
    code = b.code || code;
    message = b.error || message;
  } catch { /* not our JSON error body */ }
  if (resp.status === 401 && !opts.key) onUnauthorized();
  throw new ApiError(resp.status, code, message);
}

/** A JSON answer (or null for 204). */
export async function call(method, path, opts = {}) {
  const resp = await request(method, path, opts);
  return resp.status === 204 ? null : resp.json();
}

export const get = (path, opts) => call("GET", path, opts);
export const post = (path, json, opts = {}) => call("POST", path, { ...opts, json: json ?? {} });
export const del = (path) => call("DELETE", path);
export const patch = (path, json) => call("PATCH", path, { json });

/** A path with a query string built from `params` (undefined ones left out). */
export function withQuery(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null) q.append(k, String(v));
  const s = q.toString();
  return s ? `${path}?${s}` : path;
}

export const sandboxPath = (id, rest = "") => `/v1/sandboxes/${encodeURIComponent(id)}${rest}`;
