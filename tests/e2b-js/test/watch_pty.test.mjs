// Directory watches (the JS SDK streams WatchDir) and PTY sessions.
import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'
import { CommandExitError, FileType, FilesystemEventType, NotFoundError, Sandbox } from 'e2b'
import { waitFor } from './helpers.mjs'

let sb
before(async () => {
  sb = await Sandbox.create({ timeoutMs: 600_000 })
})
after(async () => {
  await sb?.kill()
})

const has = (events, name, type) => events.some((e) => e.name === name && e.type === type)

test('watchDir streams create, write, chmod, rename and remove, then stops', async () => {
  await sb.files.makeDir('w')
  const got = []
  const exited = []
  const handle = await sb.files.watchDir('w', (e) => got.push(e), { onExit: (err) => exited.push(err) })
  await sb.files.write('w/a.txt', 'hi')
  await waitFor('create of a.txt', () => has(got, 'a.txt', FilesystemEventType.CREATE))
  // The upload's temporary file is not reported.
  assert.ok(got.every((e) => e.name === 'a.txt'), JSON.stringify(got))
  await sb.commands.run('echo more >> /home/user/w/a.txt && chmod 600 /home/user/w/a.txt' +
    ' && mv /home/user/w/a.txt /home/user/w/b.txt && rm /home/user/w/b.txt')
  // A move shows as rename of the old name and create of the new one, as
  // E2B's envd (fsnotify) reports it.
  await waitFor('write, chmod, rename, create and remove', () =>
    has(got, 'a.txt', FilesystemEventType.WRITE) && has(got, 'a.txt', FilesystemEventType.CHMOD) &&
    has(got, 'a.txt', FilesystemEventType.RENAME) && has(got, 'b.txt', FilesystemEventType.CREATE) &&
    has(got, 'b.txt', FilesystemEventType.REMOVE))
  await handle.stop()
  // The SDK ends the stream by aborting its request: onExit gets its own
  // cancellation (as against E2B), once.
  await waitFor('onExit', () => exited.length === 1)
  assert.ok(exited[0] === undefined || /canceled/.test(exited[0].message), exited[0])
  const before = got.length
  await sb.files.write('w/after-stop.txt', 'x')
  await sb.commands.run('true')
  assert.equal(got.length, before)
})

test('a watch past its timeoutMs ends with onExit', async () => {
  await sb.files.makeDir('tw')
  const exited = []
  await sb.files.watchDir('tw', () => {}, { timeoutMs: 1_000, onExit: (err) => exited.push(err) })
  await waitFor('onExit', () => exited.length === 1, { timeoutMs: 15_000 })
})

test('a recursive watch names nested paths relative to the watched directory, with entries', async () => {
  await sb.files.makeDir('rwatch/sub')
  const got = []
  const handle = await sb.files.watchDir('rwatch', (e) => got.push(e), { recursive: true, includeEntry: true })
  try {
    await sb.files.write('rwatch/sub/deep.txt', 'x')
    await sb.files.write('rwatch/new/deeper/f.txt', 'y')
    await waitFor('nested writes', () =>
      has(got, 'sub/deep.txt', FilesystemEventType.WRITE) && has(got, 'new/deeper/f.txt', FilesystemEventType.WRITE))
    const created = got.find((e) => e.name === 'sub/deep.txt' && e.type === FilesystemEventType.CREATE)
    assert.ok(created, JSON.stringify(got))
    assert.equal(created.entry?.path, '/home/user/rwatch/sub/deep.txt')
    assert.equal(created.entry?.type, FileType.FILE)
  } finally {
    await handle.stop()
  }
})

test('watching a missing directory is NotFoundError', async () => {
  await assert.rejects(sb.files.watchDir('no/such/dir', () => {}), NotFoundError)
})

test('pty: create, input, resize, kill', async () => {
  let out = ''
  const decoder = new TextDecoder()
  const handle = await sb.pty.create({ rows: 24, cols: 80, onData: (d) => { out += decoder.decode(d, { stream: true }) } })
  const ended = handle.wait().then(
    (r) => r,
    (e) => e,
  )
  const enc = new TextEncoder()
  await sb.pty.sendInput(handle.pid, enc.encode('stty size; echo pty-$((6*7))\n'))
  await waitFor('24 80', () => out.includes('24 80'))
  await waitFor('pty-42', () => out.includes('pty-42'))
  assert.ok((await sb.commands.list()).some((p) => p.pid === handle.pid))
  await sb.pty.resize(handle.pid, { rows: 30, cols: 100 })
  await sb.pty.sendInput(handle.pid, enc.encode('stty size\n'))
  await waitFor('30 100', () => out.includes('30 100'))
  assert.equal(await sb.pty.kill(handle.pid), true)
  const end = await ended
  assert.ok(end instanceof CommandExitError, `pty ended with ${end}`)
  assert.notEqual(end.exitCode, 0)
  assert.ok(!(await sb.commands.list()).some((p) => p.pid === handle.pid))
})

test('pty: exit ends it with its code, envs and cwd apply', async () => {
  let out = ''
  const handle = await sb.pty.create({
    rows: 24, cols: 80, envs: { PTY_VAR: 'set' }, cwd: '/tmp',
    onData: (d) => { out += new TextDecoder().decode(d) },
  })
  await sb.pty.sendInput(handle.pid, new TextEncoder().encode('echo $PTY_VAR-$(pwd); exit 0\n'))
  const r = await handle.wait()
  assert.equal(r.exitCode, 0)
  assert.ok(out.includes('set-/tmp'), out)
  await assert.rejects(sb.pty.sendInput(999_999, new Uint8Array([1])), NotFoundError)
})
