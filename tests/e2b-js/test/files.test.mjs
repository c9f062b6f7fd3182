// Files through /files (uploads, downloads) and the filesystem service.
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { after, before, test } from 'node:test'
import { FileType, NotFoundError, Sandbox, SandboxError } from 'e2b'
import { GVISOR_STATX, GVISOR_XATTRS, onClass } from './helpers.mjs'

let sb
before(async () => {
  sb = await Sandbox.create({ timeoutMs: 600_000 })
})
after(async () => {
  await sb?.kill()
})

test('write and read text, bytes, blobs and streams', onClass('gvisor', GVISOR_STATX), async () => {
  const info = await sb.files.write('notes/a.txt', 'hello')
  assert.equal(info.path, '/home/user/notes/a.txt')
  assert.equal(info.name, 'a.txt')
  assert.equal(await sb.files.read('notes/a.txt'), 'hello')
  const bin = new Uint8Array([0, 1, 255])
  await sb.files.write('/tmp/b.bin', bin.buffer)
  assert.deepEqual(await sb.files.read('/tmp/b.bin', { format: 'bytes' }), bin)
  const big = randomBytes(3 << 20)
  await sb.files.write('up/blob.bin', new Blob([big]))
  const blob = await sb.files.read('up/blob.bin', { format: 'blob' })
  assert.ok(Buffer.from(await blob.arrayBuffer()).equals(big))
  const stream = await sb.files.read('up/blob.bin', { format: 'stream' })
  const chunks = []
  for await (const c of stream) chunks.push(c)
  assert.ok(Buffer.concat(chunks).equals(big))
  // The file is the user's, with the mode a shell with umask 022 gives.
  assert.equal((await sb.commands.run('stat -c %U:%a /home/user/notes/a.txt')).stdout, 'user:644\n')
})

test('write many files at once', async () => {
  const infos = await sb.files.write([
    { path: 'many/x', data: '1' },
    { path: 'many/y', data: new TextEncoder().encode('2').buffer },
  ])
  assert.deepEqual(infos.map((i) => i.name).sort(), ['x', 'y'])
  assert.equal(await sb.files.read('many/y'), '2')
})

test('reading a missing file is NotFoundError', async () => {
  await assert.rejects(sb.files.read('/nope/nothing'), NotFoundError)
})

test('list with depth, exists, getInfo', async () => {
  await sb.files.write('tree/a/b/c.txt', 'c')
  const top = await sb.files.list('tree')
  assert.deepEqual(top.map((e) => e.name), ['a'])
  assert.equal(top[0].type, FileType.DIR)
  const deep = await sb.files.list('tree', { depth: 3 })
  assert.deepEqual(
    new Set(deep.map((e) => e.path)),
    new Set(['/home/user/tree/a', '/home/user/tree/a/b', '/home/user/tree/a/b/c.txt']),
  )
  assert.equal(await sb.files.exists('tree/a/b/c.txt'), true)
  assert.equal(await sb.files.exists('tree/zzz'), false)
  const info = await sb.files.getInfo('tree/a/b/c.txt')
  assert.equal(info.size, 1)
  assert.equal(info.type, FileType.FILE)
  assert.equal(info.owner, 'user')
  assert.equal(info.permissions, '-rw-r--r--')
  assert.ok(info.modifiedTime instanceof Date && !Number.isNaN(info.modifiedTime.getTime()), info.modifiedTime)
  await assert.rejects(sb.files.list('tree/zzz'), NotFoundError)
  await assert.rejects(sb.files.getInfo('tree/zzz'), NotFoundError)
})

test('makeDir, rename, remove', async () => {
  assert.equal(await sb.files.makeDir('made/sub'), true)
  assert.equal(await sb.files.makeDir('made/sub'), false)
  await sb.files.write('made/sub/f', 'x')
  const moved = await sb.files.rename('made/sub/f', 'made/g')
  assert.equal(moved.path, '/home/user/made/g')
  assert.equal(await sb.files.read('made/g'), 'x')
  await assert.rejects(sb.files.rename('made/none', 'made/other'), NotFoundError)
  await sb.files.remove('made')
  assert.equal(await sb.files.exists('made'), false)
  // Removing what is not there succeeds, as envd's does.
  await sb.files.remove('made')
})

test('files written as root and read by root', async () => {
  await sb.files.write('/root/r.txt', 'root only', { user: 'root' })
  assert.equal(await sb.files.read('/root/r.txt', { user: 'root' }), 'root only')
  // The default user may not: envd's permission error, 403.
  await assert.rejects(sb.files.read('/root/r.txt'), (e) => e instanceof SandboxError && /403/.test(e.message))
})

test('gzip, octet-stream and streamed uploads round trip', async () => {
  const data = Buffer.concat([randomBytes(1 << 20), Buffer.alloc(2 << 20)])
  await sb.files.write('up/gz.bin', new Blob([data]), { gzip: true })
  assert.ok(Buffer.from(await sb.files.read('up/gz.bin', { format: 'bytes', gzip: true })).equals(data))
  await sb.files.write('up/oct.bin', new Blob([data]), { useOctetStream: true })
  assert.ok(Buffer.from(await sb.files.read('up/oct.bin', { format: 'bytes' })).equals(data))
  const parts = [0, 1, 2, 3].map((i) => new Uint8Array(256 << 10).fill(i))
  const stream = new ReadableStream({
    pull(c) {
      const next = parts.shift()
      if (next) c.enqueue(next)
      else c.close()
    },
  })
  const info = await sb.files.write('up/stream.bin', stream)
  assert.equal(info.path, '/home/user/up/stream.bin')
  const back = Buffer.from(await sb.files.read('up/stream.bin', { format: 'bytes' }))
  assert.equal(back.length, 1 << 20)
  assert.deepEqual([0, 1, 2, 3].map((i) => back[i * (256 << 10)]), [0, 1, 2, 3])
})

test('file metadata is stored and read back', onClass('gvisor', GVISOR_XATTRS), async () => {
  const info = await sb.files.write('meta/m.txt', 'x', { metadata: { Origin: 'js-sdk', kind: 'note' } })
  assert.deepEqual(info.metadata, { origin: 'js-sdk', kind: 'note' })
  assert.deepEqual((await sb.files.getInfo('meta/m.txt')).metadata, { origin: 'js-sdk', kind: 'note' })
  assert.deepEqual((await sb.files.list('meta'))[0].metadata, { origin: 'js-sdk', kind: 'note' })
})

test('signed upload and download URLs work, and refuse what they were not signed for', async () => {
  const base = process.env.E2B_SANDBOX_URL
  const up = await sb.uploadUrl('signed/u.txt')
  assert.ok(up.startsWith(base), up)
  const form = new FormData()
  form.append('file', new Blob(['signed body']), 'u.txt')
  const put = await fetch(up, { method: 'POST', body: form })
  assert.equal(put.status, 200, await put.text())
  const down = await sb.downloadUrl('signed/u.txt', { useSignatureExpiration: 60 })
  assert.match(down, /signature_expiration=/)
  const got = await fetch(down)
  assert.equal(got.status, 200)
  assert.equal(await got.text(), 'signed body')
  // A download URL is not an upload URL, and an altered one is refused.
  const wrongOp = await fetch(down, { method: 'POST', body: form })
  assert.equal(wrongOp.status, 401, await wrongOp.text())
  const other = new URL(down)
  other.searchParams.set('path', 'signed/other.txt')
  const altered = await fetch(other)
  assert.equal(altered.status, 401, await altered.text())
})

test('paths with spaces, unicode and URL characters round trip', async () => {
  const names = ['sp ace/ünï.txt', '百度/文件.txt', 'a+b&c?=d;e.txt', 'pct%20.txt']
  for (const n of names) {
    assert.equal((await sb.files.write(`odd/${n}`, `v:${n}`)).path, `/home/user/odd/${n}`)
    assert.equal(await sb.files.read(`odd/${n}`), `v:${n}`)
  }
  // The multipart form names each file by its path.
  const infos = await sb.files.write(names.map((n) => ({ path: `oddm/${n}`, data: `m:${n}` })))
  assert.deepEqual(infos.map((i) => i.path), names.map((n) => `/home/user/oddm/${n}`))
  for (const n of names) assert.equal(await sb.files.read(`oddm/${n}`), `m:${n}`)
})
