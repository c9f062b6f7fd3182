// envd behaviours as the SDK reads them (version, symlinks, a sandbox killed
// under a streaming command) and E2B's network rules on create and update,
// seen through the native API's view of the policy the host enforces.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { FileType, Sandbox, SandboxError, TimeoutError } from 'e2b'
import { BASE, waitFor, withSandbox } from './helpers.mjs'

const PROBE = "import socket\ntry:\n    socket.getaddrinfo('example.com', 80)\n    print('resolved')\n" +
  "except OSError:\n    print('refused')"

async function native(sandboxId) {
  const r = await fetch(`${BASE}/v1/sandboxes/${sandboxId}`, {
    headers: { Authorization: `Bearer ${process.env.E2B_API_KEY}` },
  })
  assert.equal(r.status, 200, await r.clone().text())
  return (await r.json()).network
}

test('the envd version is the newest the SDK checks for', () =>
  withSandbox(async (sb) => {
    assert.equal((await sb.getInfo()).envdVersion, '0.6.4')
  }))

test('getInfo and list follow symlinks as envd does', () =>
  withSandbox(async (sb) => {
    await sb.files.write('links/target.txt', 'hello')
    await sb.files.makeDir('links/dir')
    await sb.commands.run('cd /home/user/links && ln -s target.txt rel && ln -s /home/user/links/dir absdir' +
      ' && ln -s nowhere dangling')
    const rel = await sb.files.getInfo('links/rel')
    assert.equal(rel.type, FileType.FILE)
    assert.equal(rel.symlinkTarget, '/home/user/links/target.txt')
    assert.equal(rel.mode, 0o644)
    const absdir = await sb.files.getInfo('links/absdir')
    assert.equal(absdir.type, FileType.DIR)
    const dangling = await sb.files.getInfo('links/dangling')
    assert.equal(dangling.type, undefined)
    assert.equal(dangling.symlinkTarget, '/home/user/links/dangling')
    assert.equal((await sb.files.getInfo('links/target.txt')).symlinkTarget, undefined)
    const listed = Object.fromEntries((await sb.files.list('links')).map((e) => [e.name, e]))
    assert.equal(listed.rel.type, FileType.FILE)
    assert.equal(listed.absdir.type, FileType.DIR)
  }))

test('a sandbox killed while a command streams rejects with the SDK TimeoutError', async () => {
  const sb = await Sandbox.create()
  try {
    const running = sb.commands.run('sleep 60 # js-killed', { timeoutMs: 120_000 }).then(() => null, (e) => e)
    await waitFor('the command', async () =>
      (await sb.commands.list()).some((p) => [p.cmd, ...p.args].join(' ').includes('js-killed')))
    await Sandbox.kill(sb.sandboxId)
    const e = await running
    assert.ok(e instanceof TimeoutError, e)
    assert.match(e.message, /was not found/)
    // And calls after it.
    await assert.rejects(sb.commands.list(), TimeoutError)
    await assert.rejects(sb.files.read('anything.txt'), TimeoutError)
  } finally {
    await sb.kill()
  }
})

test('network rules on create map onto host policies', async () => {
  const made = []
  try {
    const off = await Sandbox.create({ allowInternetAccess: false })
    made.push(off)
    const net = await native(off.sandboxId)
    assert.deepEqual([net.egress, net.applied], ['deny_all', 'deny_all'])
    assert.equal((await off.getInfo()).allowInternetAccess, false)
    const listed = await Sandbox.create({ network: { allowOut: ['pypi.org', '1.1.1.1'], denyOut: ['0.0.0.0/0'] } })
    made.push(listed)
    const lnet = await native(listed.sandboxId)
    assert.deepEqual([lnet.egress, [...lnet.allow].sort()], ['default', ['1.1.1.1/32', 'pypi.org']])
    assert.equal((await listed.commands.run(`python3 -c "${PROBE}"`)).stdout.trim(), 'refused')
    const info = (await listed.getInfo()).network
    assert.deepEqual([info.allowOut, info.denyOut], [['pypi.org', '1.1.1.1'], ['0.0.0.0/0']])
  } finally {
    for (const sb of made) await sb.kill()
  }
})

test('bad rules are refused before anything starts', async () => {
  const tag = `bad-${process.pid}-${Date.now()}`
  for (const network of [{ allowOut: ['pypi.org'] }, { denyOut: ['pypi.org'] }, { denyOut: ['10.0.0.0/33'] }]) {
    await assert.rejects(Sandbox.create({ network, metadata: { tag } }), (e) => {
      assert.ok(e instanceof SandboxError, e)
      assert.equal(e.statusCode, 400)
      return true
    })
  }
  assert.deepEqual(await Sandbox.list({ query: { metadata: { tag } } }).nextItems(), [])
})

test('updateNetwork opens, lists and closes a running sandbox', () =>
  withSandbox(async (sb) => {
    await sb.updateNetwork({ denyOut: ['198.51.100.0/24'] })
    let net = await native(sb.sandboxId)
    assert.deepEqual([net.egress, net.deny, net.applied], ['default', ['198.51.100.0/24'], 'default'])
    await sb.updateNetwork({ allowOut: ['pypi.org'], denyOut: ['0.0.0.0/0'] })
    net = await native(sb.sandboxId)
    assert.deepEqual([net.egress, net.allow], ['default', ['pypi.org']])
    await sb.updateNetwork({ denyOut: ['0.0.0.0/0'] })
    net = await native(sb.sandboxId)
    assert.deepEqual([net.egress, net.applied], ['deny_all', 'deny_all'])
    await sb.updateNetwork({})
    net = await native(sb.sandboxId)
    assert.deepEqual([net.egress, net.applied], ['default', 'default'])
    assert.equal((await sb.commands.run('echo still')).stdout, 'still\n')
    await sb.pause()
    await assert.rejects(sb.updateNetwork({}), (e) => e instanceof SandboxError && e.statusCode === 409)
  }, { allowInternetAccess: false }))
