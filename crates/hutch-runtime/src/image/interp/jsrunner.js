// hutch's JavaScript context for the code interpreter (server.py): one Node
// process per context, whose global scope persists from one execution to
// the next, as in Node's REPL.
//
// Requests arrive as JSON lines on the descriptor named by HUTCH_IN_FD:
//   {"op": "execute", "id", "code"}   run code; the value of its last
//                                     expression is the result
//   {"op": "env", "id", "set": {k: v or null}}   set (or, null, unset)
//                                     variables of process.env
// Events leave as JSON lines on HUTCH_OUT_FD, each naming its request:
//   {"id", "type": "stdout"|"stderr", "text"}, {"id", "type": "result",
//   "text"}, {"id", "type": "error", "name", "value", "traceback"},
//   {"id", "type": "done"}; and {"type": "ready"} once at start.
// Top-level `await` is rewritten as the REPL does it (Node's own
// internal/repl/await, hence --expose-internals). SIGINT stops a running
// synchronous script (breakOnSigint) and fails a pending await.
'use strict';

const fs = require('fs');
const path = require('path');
const util = require('util');
const vm = require('vm');
const { Console } = require('console');
const Module = require('module');

const IN = Number(process.env.HUTCH_IN_FD);
const OUT = Number(process.env.HUTCH_OUT_FD);
delete process.env.HUTCH_IN_FD;
delete process.env.HUTCH_OUT_FD;

let rewriteAwait = null;
try {
  rewriteAwait = require('internal/repl/await').processTopLevelAwait;
} catch (_) {
  // Without it, code with a top-level await fails as a SyntaxError.
}

function send(event) {
  const line = JSON.stringify(event) + '\n';
  const buf = Buffer.from(line);
  let off = 0;
  while (off < buf.length) {
    try {
      off += fs.writeSync(OUT, buf, off, buf.length - off);
    } catch (e) {
      if (e.code === 'EAGAIN') continue;
      process.exit(1);
    }
  }
}

// The request whose output is being collected; output with none is dropped.
let current = null;

function output(name) {
  return (chunk, encoding, callback) => {
    if (typeof encoding === 'function') {
      callback = encoding;
      encoding = undefined;
    }
    const text = typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString('utf8');
    if (current !== null && text.length > 0) send({ id: current, type: name, text });
    if (typeof callback === 'function') callback();
    return true;
  };
}

process.stdout.write = output('stdout');
process.stderr.write = output('stderr');
globalThis.console = new Console({ stdout: process.stdout, stderr: process.stderr });
globalThis.require = Module.createRequire(path.join(process.cwd(), '[hutch]'));
globalThis.module = { exports: {}, require: globalThis.require };
globalThis.exports = globalThis.module.exports;

let interrupted = null;
process.on('SIGINT', () => {
  if (interrupted) interrupted(new Error('Script execution was interrupted by SIGINT'));
});

function describeError(e) {
  if (e instanceof Error) {
    return { name: e.name || 'Error', value: e.message || '', traceback: e.stack || String(e) };
  }
  return { name: 'Error', value: util.inspect(e), traceback: util.inspect(e) };
}

let cell = 0;

async function execute(code) {
  cell += 1;
  let source = code;
  let wrapped = false;
  if (rewriteAwait && /\bawait\b/.test(code)) {
    const rewritten = rewriteAwait(code);
    if (rewritten !== null) {
      source = rewritten;
      wrapped = true;
    }
  }
  const script = new vm.Script(source, {
    filename: `cell${cell}.js`,
    importModuleDynamically: (specifier) => import(specifier),
  });
  let value = script.runInThisContext({ breakOnSigint: true, displayErrors: false });
  if (wrapped) {
    const pending = new Promise((resolve, reject) => {
      interrupted = reject;
      Promise.resolve(value).then(resolve, reject);
    });
    try {
      const settled = await pending;
      value = settled === undefined ? undefined : settled.value;
    } finally {
      interrupted = null;
    }
  }
  return value;
}

async function handle(req) {
  current = req.id;
  try {
    if (req.op === 'execute') {
      const value = await execute(String(req.code));
      if (value !== undefined) {
        send({ id: req.id, type: 'result', text: util.inspect(value, { depth: 6, maxArrayLength: 200 }) });
      }
    } else if (req.op === 'env') {
      for (const [k, v] of Object.entries(req.set || {})) {
        if (v === null) delete process.env[k];
        else process.env[k] = String(v);
      }
    }
  } catch (e) {
    send({ id: req.id, type: 'error', ...describeError(e) });
  } finally {
    send({ id: req.id, type: 'done' });
    current = null;
  }
}

// Requests are served one after the other.
let queue = Promise.resolve();
let pending = '';
const input = fs.createReadStream(null, { fd: IN, encoding: 'utf8' });
input.on('data', (chunk) => {
  pending += chunk;
  let nl;
  while ((nl = pending.indexOf('\n')) >= 0) {
    const line = pending.slice(0, nl);
    pending = pending.slice(nl + 1);
    if (!line.trim()) continue;
    let req;
    try {
      req = JSON.parse(line);
    } catch (_) {
      continue;
    }
    queue = queue.then(() => handle(req));
  }
});
input.on('end', () => process.exit(0));

// Errors of code that outlives its execution (timers, callbacks) are
// reported to whatever runs now, and never end the context.
process.on('uncaughtException', (e) => {
  if (current !== null) send({ id: current, type: 'error', ...describeError(e) });
});
process.on('unhandledRejection', (e) => {
  if (current !== null) send({ id: current, type: 'error', ...describeError(e) });
});

send({ type: 'ready' });
