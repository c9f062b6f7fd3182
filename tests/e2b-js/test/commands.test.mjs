// Commands through the SDK's process service (Connect RPC, JSON codec,
// server streams over fetch).
import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'
import { CommandExitError, NotFoundError, Sandbox, TimeoutError } from 'e2b'
import { waitFor } from './helpers.mjs'

let sb
before(async () => {
  sb = await Sandbox.create({ envs: { SUITE_VAR: 'hutch' }, timeoutMs: 600_000 })
})
after(async () => {
  await sb?.kill()
})

test('foreground output streams to the callbacks', async () => {
  const out = []
  const err = []
  const r = await sb.commands.run('echo one; echo two >&2; echo three', {
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'one\nthree\n')
  assert.equal(r.stderr, 'two\n')
  assert.equal(out.join(''), 'one\nthree\n')
  assert.equal(err.join(''), 'two\n')
})

test('sandbox envs, command envs, cwd and users', async () => {
  assert.equal((await sb.commands.run('echo $SUITE_VAR')).stdout, 'hutch\n')
  assert.equal((await sb.commands.run('echo $X-$SUITE_VAR', { envs: { X: 'y' } })).stdout, 'y-hutch\n')
  assert.equal((await sb.commands.run('whoami; pwd')).stdout, 'user\n/home/user\n')
  assert.equal((await sb.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
  assert.equal((await sb.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
})

test('a non-zero exit rejects with CommandExitError', async () => {
  await assert.rejects(sb.commands.run('echo bad >&2; echo some; exit 3'), (e) => {
    assert.ok(e instanceof CommandExitError, e)
    assert.equal(e.exitCode, 3)
    assert.equal(e.stderr, 'bad\n')
    assert.equal(e.stdout, 'some\n')
    return true
  })
})

test('a command past its timeout rejects with TimeoutError and is killed', async () => {
  await assert.rejects(sb.commands.run('sleep 30 # js-timeout', { timeoutMs: 1_000 }), TimeoutError)
  // Killed at its deadline; gone once the sandbox's kernel delivered the
  // kill and the agent reaped it (a moment longer under gVisor).
  await waitFor('the timed-out command to end', async () =>
    !(await sb.commands.list()).some((p) => [p.cmd, ...p.args].join(' ').includes('js-timeout')))
})

test('background: wait for the result, list, kill', async () => {
  const out = []
  const h = await sb.commands.run('sleep 0.3; echo done', { background: true, onStdout: (d) => out.push(d) })
  assert.ok(h.pid > 0)
  const r = await h.wait()
  assert.equal(r.stdout, 'done\n')
  assert.equal(r.exitCode, 0)
  assert.equal(out.join(''), 'done\n')

  const long = await sb.commands.run('sleep 60', { background: true })
  assert.ok((await sb.commands.list()).some((p) => p.pid === long.pid))
  assert.equal(await long.kill(), true)
  await assert.rejects(long.wait(), CommandExitError)
  assert.ok(!(await sb.commands.list()).some((p) => p.pid === long.pid))
  assert.equal(await sb.commands.kill(999_999), false)
})

test('stdin: send, then close', async () => {
  const h = await sb.commands.run('cat', { background: true, stdin: true })
  await sb.commands.sendStdin(h.pid, 'hello\n')
  await h.sendStdin('again\n')
  await sb.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.stdout, 'hello\nagain\n')
})

test('connect to a running pid, and to an unknown one', async () => {
  // The command waits for its stdin, so it still runs when connected to.
  const h = await sb.commands.run('read line; echo later-$line', { background: true, stdin: true })
  const again = await sb.commands.connect(h.pid)
  await sb.commands.sendStdin(h.pid, 'on\n')
  assert.match((await again.wait()).stdout, /later-on\n$/)
  await assert.rejects(sb.commands.connect(999_999), NotFoundError)
  await assert.rejects(sb.commands.sendStdin(999_999, 'x'), NotFoundError)
})

test('a command killed by the sandbox ending rejects', async () => {
  const other = await Sandbox.create()
  try {
    const h = await other.commands.run('sleep 120', { background: true })
    const waited = h.wait().then(
      () => null,
      (e) => e,
    )
    await other.kill()
    const e = await waited
    assert.ok(e instanceof Error, `wait resolved: ${e}`)
    assert.ok(e instanceof TimeoutError || e instanceof CommandExitError, e)
  } finally {
    await other.kill()
  }
})
