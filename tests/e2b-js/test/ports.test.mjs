// A sandbox's ports by E2B's host names (`sandbox.getHost(port)`, under the
// daemon's --e2b-domain), reached through hutch's proxy, as a client that
// resolves the domain to this machine reaches them; public and
// token-guarded ports.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { Sandbox } from 'e2b'
import { PORT_DOMAIN, fetchResolved, getVia, waitFor, withSandbox, withSandboxes } from './helpers.mjs'

// Answers every GET with the Host and headers it saw, as JSON.
const ECHO = `
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"host": self.headers.get("Host"), "path": self.path,
                           "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
`
const PORT = 8000
const TOKEN_HEADER = 'e2b-traffic-access-token'

async function serve(sb) {
  await sb.files.write('/home/user/echo.py', ECHO)
  await sb.commands.run(`python3 /home/user/echo.py ${PORT}`, { background: true, timeoutMs: 0 })
}

const waitOpen = (host, headers = {}) =>
  waitFor(`${host} to answer`, async () => {
    const r = await getVia(host, '/', headers)
    return r.status === 200 && r
  }, { timeoutMs: 20_000 })

test('getHost names the port under the domain, and reaches it', async () => {
  let host
  await withSandbox(async (sb) => {
    host = sb.getHost(PORT)
    assert.equal(host, `${PORT}-${sb.sandboxId}.${PORT_DOMAIN}`)
    assert.equal(sb.trafficAccessToken, undefined)
    // Nothing listens yet: E2B's answer for a closed port.
    const closed = await getVia(host)
    assert.equal(closed.status, 502, closed.text)
    assert.equal(closed.json().message, 'The sandbox is running but port is not open')
    await serve(sb)
    const r = await waitOpen(host)
    assert.equal(r.json().host, host)
    assert.equal((await getVia(host, '/a/b?c=d')).json().path, '/a/b?c=d')
    // fetch by URL, the domain resolved to this machine.
    const res = await fetchResolved(`http://${host}/by-url`)
    assert.equal(res.status, 200)
    assert.deepEqual(await res.json().then((j) => [j.host, j.path]), [host, '/by-url'])
  })
  const gone = await getVia(host)
  assert.equal(gone.status, 502, gone.text)
  assert.match(gone.json().message, /was not found/)
})

test('private ports want their sandbox traffic token', () =>
  withSandboxes([[{ network: { allowPublicTraffic: false } }], [{ network: { allowPublicTraffic: false } }]],
    async (priv, other) => {
      const token = priv.trafficAccessToken
      assert.ok(token && token !== other.trafficAccessToken)
      assert.equal((await Sandbox.connect(priv.sandboxId)).trafficAccessToken, token)
      assert.equal((await priv.getInfo()).network?.allowPublicTraffic, false)
      await serve(priv)
      const host = priv.getHost(PORT)
      const r = await waitOpen(host, { [TOKEN_HEADER]: token })
      // The token never reaches the application.
      assert.equal(r.json().headers[TOKEN_HEADER], undefined)
      const missing = await getVia(host)
      assert.equal(missing.status, 403, missing.text)
      assert.match(missing.json().message, /is missing/)
      for (const bad of ['wrong', other.trafficAccessToken, token + 'x']) {
        const w = await getVia(host, '/', { [TOKEN_HEADER]: bad })
        assert.equal(w.status, 403, w.text)
        assert.match(w.json().message, /is invalid/)
      }
    }))

test('a request to a paused sandbox with autoResume resumes it', () =>
  withSandbox(async (sb) => {
    assert.equal((await sb.getInfo()).lifecycle?.autoResume, true)
    await serve(sb)
    const host = sb.getHost(PORT)
    await waitOpen(host)
    await sb.pause()
    assert.equal((await sb.getInfo()).state, 'paused')
    const r = await fetchResolved(`http://${host}/after-pause`)
    assert.equal(r.status, 200)
    assert.equal((await r.json()).path, '/after-pause')
    assert.equal((await sb.getInfo()).state, 'running')
  }, { lifecycle: { onTimeout: 'pause', autoResume: true } }))
