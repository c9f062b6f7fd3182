// What every test file shares: the daemon the driver (tests/e2b/test_js.py)
// started, read from the environment the SDK itself reads (E2B_API_URL,
// E2B_SANDBOX_URL, E2B_API_KEY), plus E2B_OTHER_API_KEY, a second key of
// another owner, and E2B_TEST_PORT_DOMAIN, the daemon's --e2b-domain. A
// missing variable fails loudly: nothing is skipped.
import http from 'node:http'
import { setTimeout as sleep } from 'node:timers/promises'
import { Sandbox } from 'e2b'
import { Agent, fetch } from 'undici'

for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY', 'E2B_OTHER_API_KEY', 'E2B_TEST_PORT_DOMAIN']) {
  if (!process.env[name]) {
    throw new Error(`${name} is not set: run these tests through tests/e2b/test_js.py`)
  }
}

export const BASE = process.env.E2B_API_URL
export const OTHER_KEY = process.env.E2B_OTHER_API_KEY
export const PORT_DOMAIN = process.env.E2B_TEST_PORT_DOMAIN
// The daemon's default class (tests/e2b/conftest.py's TEST_CLASS).
export const CLASS = process.env.HUTCH_TEST_CLASS || 'container'

// What the gvisor class's runsc (Debian 12's) does not do, as in
// tests/e2b/conftest.py: a test that needs it is `todo` in that class.
export const GVISOR_STATX = "runsc 20221219 refuses statx(AT_NO_AUTOMOUNT): coreutils' stat and ls fail"
export const GVISOR_XATTRS = "runsc 20221219's gofer refuses user.* xattrs (EOPNOTSUPP)"
export function onClass(cls, reason) {
  return CLASS === cls ? { todo: `${cls} class: ${reason}` } : {}
}

// Polls `predicate` (sync or async) until it answers something truthy, at
// most `timeoutMs`; a wait on a condition, never a fixed sleep.
export async function waitFor(what, predicate, { timeoutMs = 10_000, intervalMs = 100 } = {}) {
  const deadline = Date.now() + timeoutMs
  let last
  for (;;) {
    last = await predicate()
    if (last) return last
    if (Date.now() >= deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what} (last: ${String(last)})`)
    }
    await sleep(intervalMs)
  }
}

// Runs `body` with fresh sandboxes made by `Sandbox.create(...args)` for
// each entry of `specs`, and kills them after, also when `body` fails.
export async function withSandboxes(specs, body) {
  const made = []
  try {
    for (const args of specs) made.push(await Sandbox.create(...args))
    return await body(...made)
  } finally {
    for (const sb of made) await sb.kill().catch(() => {})
  }
}

export function withSandbox(body, ...args) {
  return withSandboxes([args], body)
}

// A GET to the daemon naming `host` in Host, as a client that resolves the
// E2B domain to this machine sends it, on a connection of its own (the
// daemon closes the connections that reached a sandbox when it pauses or
// ends, and a kept-alive one may be reused just as it closes):
// {status, headers, text, json()}.
export function getVia(host, path = '/', headers = {}) {
  const url = new URL(BASE)
  return new Promise((resolve, reject) => {
    const req = http.get(
      { host: url.hostname, port: url.port, path, headers: { ...headers, Host: host }, agent: false, timeout: 30_000 },
      (res) => {
        const chunks = []
        res.on('data', (c) => chunks.push(c))
        res.on('end', () => {
          const text = Buffer.concat(chunks).toString()
          resolve({ status: res.statusCode, headers: res.headers, text, json: () => JSON.parse(text) })
        })
        res.on('error', reject)
      },
    )
    req.on('timeout', () => req.destroy(new Error(`GET ${host}${path} timed out`)))
    req.on('error', reject)
  })
}

// fetch with every host name resolved to the daemon's address: what a client
// sees when the operator's E2B domain is a wildcard record for this machine.
const resolveToDaemon = new Agent({
  connect: {
    lookup: (_hostname, opts, cb) => {
      const address = new URL(BASE).hostname
      if (opts?.all) cb(null, [{ address, family: 4 }])
      else cb(null, address, 4)
    },
  },
})

export function fetchResolved(url, init = {}) {
  return fetch(url, { ...init, dispatcher: resolveToDaemon })
}
