// A terminal into a sandbox: xterm.js over the PTY WebSocket
// (`GET /v1/sandboxes/{id}/pty`, see docs/api.md, "Terminals"). Browsers
// cannot set headers on a WebSocket, so the key goes as the subprotocol
// `hutch.bearer.<key>` beside `hutch.pty`, never in the URL.

import { Terminal } from "./xterm.mjs";
import { FitAddon } from "./addon-fit.mjs";
import { key } from "./api.js";
import { el, fill } from "./dom.js";

/** Opens a terminal in `box` on the PTY route `path`; returns {close}. */
export function openTerminal(box, path) {
  if (!Terminal) {
    fill(box, el("p", { class: "message" },
      "This daemon was built without xterm.js (console/node_modules was missing): run `npm ci` in console/ and build again."));
    return { close() {} };
  }
  box.replaceChildren();
  const term = new Terminal({ cursorBlink: true, fontSize: 14, scrollback: 5000 });
  const fit = new FitAddon();
  term.loadAddon(fit);
  withStyleNonce(() => term.open(box));
  fit.fit();

  const url = new URL(path, location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  url.search = new URLSearchParams({ cols: term.cols, rows: term.rows }).toString();
  const ws = new WebSocket(url, ["hutch.pty", `hutch.bearer.${key.get()}`]);
  ws.binaryType = "arraybuffer";
  const encoder = new TextEncoder();
  const say = (text) => term.write(`\r\n\x1b[2m${text}\x1b[0m\r\n`);

  // What is typed before the socket opens is sent once it is.
  let early = [];
  ws.onopen = () => {
    for (const d of early) ws.send(d);
    early = null;
    term.focus();
  };
  ws.onmessage = (ev) => {
    if (typeof ev.data !== "string") { term.write(new Uint8Array(ev.data)); return; }
    let m;
    try { m = JSON.parse(ev.data); } catch { return; }
    if (m.type === "exit") say(`[exited with ${m.exit_code}]`);
    else if (m.type === "error") say(`[${m.error} (${m.code})]`);
  };
  // The server refuses before the upgrade (401, 404, 409, 429) with a JSON
  // body the browser does not show scripts: only that it closed.
  ws.onclose = (ev) => say(ev.code === 1006 ? "[the terminal could not be opened or was cut]" : `[closed: ${ev.reason || ev.code}]`);
  const input = term.onData((d) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(encoder.encode(d));
    else if (early) early.push(encoder.encode(d));
  });
  const resize = term.onResize(({ cols, rows }) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", cols, rows }));
  });
  const observer = new ResizeObserver(() => fit.fit());
  observer.observe(box);

  return {
    close() {
      observer.disconnect();
      input.dispose();
      resize.dispose();
      ws.onclose = null;
      ws.close();
      term.dispose();
    },
  };
}

// xterm.js gives 24-bit colours as `style` attributes, which the policy
// refuses (it admits no inline style, so that injected markup could carry
// none). The same declarations through the CSSOM are allowed, and mean the
// same: the console's own code sets no style attribute, so every such call
// in the page is routed there.
const setAttribute = Element.prototype.setAttribute;
Element.prototype.setAttribute = function (name, value) {
  if (this instanceof HTMLElement && String(name).toLowerCase() === "style") {
    this.style.cssText = String(value);
    return;
  }
  setAttribute.call(this, name, value);
};

/** Runs `f` with every <style> element created meanwhile carrying the
 *  page's style nonce: xterm.js writes its measured cell size and colours
 *  in <style> elements, which the page's CSP admits by that nonce only. */
function withStyleNonce(f) {
  const nonce = document.querySelector('meta[name="hutch-style-nonce"]')?.content;
  const create = document.createElement;
  document.createElement = function (tag, options) {
    const node = create.call(this, tag, options);
    if (nonce && String(tag).toLowerCase() === "style") node.setAttribute("nonce", nonce);
    return node;
  };
  try { f(); } finally { document.createElement = create; }
}
