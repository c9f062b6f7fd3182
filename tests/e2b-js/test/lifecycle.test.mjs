// Sandbox lifecycle through the SDK's control API client: create, info,
// kill, timeouts, list (filters, order, pages), connect, pause, and the
// SDK's errors for unknown and foreign sandboxes and bad keys.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { AuthenticationError, NotFoundError, Sandbox, SandboxError, SandboxNotFoundError } from 'e2b'
import { OTHER_KEY, waitFor, withSandbox, withSandboxes } from './helpers.mjs'

test('create with metadata and envs, then getInfo', () =>
  withSandbox(
    async (sb) => {
      assert.match(sb.sandboxId, /\S/)
      const info = await sb.getInfo()
      assert.equal(info.sandboxId, sb.sandboxId)
      assert.deepEqual(info.metadata, { suite: 'e2b-js', kind: 'info' })
      assert.equal(info.templateId, 'base')
      assert.equal(info.state, 'running')
      // RFC 3339 times read back as dates: started now, ending at the timeout.
      assert.ok(info.startedAt instanceof Date && !Number.isNaN(info.startedAt.getTime()), info.startedAt)
      assert.ok(info.endAt instanceof Date && !Number.isNaN(info.endAt.getTime()), info.endAt)
      const span = info.endAt.getTime() - info.startedAt.getTime()
      assert.ok(span > 590_000 && span <= 601_000, `timeout span ${span} ms`)
      assert.match(info.envdVersion, /^\d+\.\d+\.\d+$/)
      assert.deepEqual(await Sandbox.getInfo(sb.sandboxId), info)
      assert.equal((await sb.commands.run('echo $SUITE_VAR')).stdout, 'hutch\n')
    },
    { metadata: { suite: 'e2b-js', kind: 'info' }, envs: { SUITE_VAR: 'hutch' }, timeoutMs: 600_000 },
  ))

test('kill: not running after, a second kill is false, getInfo is SandboxNotFoundError', async () => {
  const sb = await Sandbox.create()
  assert.equal(await sb.isRunning(), true)
  assert.equal(await sb.kill(), true)
  assert.equal(await sb.isRunning(), false)
  assert.equal(await Sandbox.kill(sb.sandboxId), false)
  await assert.rejects(Sandbox.getInfo(sb.sandboxId), SandboxNotFoundError)
  // Calls to the envd of a sandbox that is gone.
  await assert.rejects(sb.commands.run('true'), SandboxNotFoundError)
})

test('setTimeout moves the end, and a short one ends the sandbox', () =>
  withSandbox(async (sb) => {
    const before = (await sb.getInfo()).endAt.getTime()
    await sb.setTimeout(900_000)
    const after = (await sb.getInfo()).endAt.getTime()
    assert.ok(after > before + 500_000, `endAt ${before} -> ${after}`)
    await Sandbox.setTimeout(sb.sandboxId, 2_000)
    await waitFor('expiry', async () => !(await sb.isRunning()), { timeoutMs: 20_000, intervalMs: 250 })
    await assert.rejects(Sandbox.setTimeout(sb.sandboxId, 10_000), NotFoundError)
  }))

test('list filters by metadata, state, template and start time, in order, by pages', async () => {
  const tag = `js-${process.pid}-${Date.now()}`
  await withSandboxes([[{ metadata: { page: tag } }]], async (first) => {
    const firstInfo = await first.getInfo()
    // One millisecond after the first started, as the daemon recorded it;
    // the others start once the host's clock has passed it.
    const cut = new Date(firstInfo.startedAt.getTime() + 1)
    await waitFor('the clock to pass the cut', () => Date.now() > cut.getTime(), { timeoutMs: 5_000, intervalMs: 1 })
    await withSandboxes([[{ metadata: { page: tag } }], [{ metadata: { page: tag } }]], async (second, third) => {
      const ids = async (opts) => {
        const pager = Sandbox.list({ ...opts, query: { metadata: { page: tag }, ...opts?.query } })
        const out = []
        while (pager.hasNext) out.push(...(await pager.nextItems()).map((s) => s.sandboxId))
        return out
      }
      const all = [first, second, third].map((s) => s.sandboxId)
      assert.deepEqual(new Set(await ids()), new Set(all))
      assert.deepEqual(await ids({ order: 'asc' }), all)
      assert.deepEqual(await ids({ order: 'desc' }), [...all].reverse())
      assert.deepEqual(new Set(await ids({ query: { startedAfter: cut } })), new Set(all.slice(1)))
      assert.deepEqual((await ids({ query: { template: 'base' } })).length, 3)
      assert.deepEqual(await ids({ query: { template: 'no-such-template' } }), [])
      assert.deepEqual(await ids({ query: { state: ['paused'] } }), [])
      // Pages of two: two, then one, then no more.
      const pager = Sandbox.list({ query: { metadata: { page: tag } }, limit: 2 })
      const one = await pager.nextItems()
      assert.equal(one.length, 2)
      assert.equal(pager.hasNext, true)
      const two = await pager.nextItems()
      assert.equal(two.length, 1)
      assert.equal(pager.hasNext, false)
      assert.deepEqual(new Set([...one, ...two].map((s) => s.sandboxId)), new Set(all))
      assert.deepEqual(one[0].metadata, { page: tag })
      assert.equal(one[0].state, 'running')
    })
  })
})

test('connect to a running sandbox, and pause then connect resumes it', () =>
  withSandbox(async (sb) => {
    await sb.files.write('kept.txt', 'still here')
    const h = await sb.commands.run('sleep 300', { background: true })
    const again = await Sandbox.connect(sb.sandboxId)
    assert.equal(again.sandboxId, sb.sandboxId)
    assert.equal(await again.files.read('kept.txt'), 'still here')
    assert.equal(await sb.pause(), true)
    assert.equal(await sb.isRunning(), false)
    const paused = await Sandbox.list({ query: { state: ['paused'] } }).nextItems()
    assert.ok(paused.some((s) => s.sandboxId === sb.sandboxId), paused)
    const resumed = await Sandbox.connect(sb.sandboxId)
    assert.equal(await resumed.isRunning(), true)
    assert.equal(await resumed.files.read('kept.txt'), 'still here')
    assert.ok((await resumed.commands.list()).some((p) => p.pid === h.pid))
    assert.equal((await resumed.commands.run('echo up')).stdout, 'up\n')
  }))

test('unknown and foreign sandboxes are not found', () =>
  withSandbox(async (sb) => {
    await assert.rejects(Sandbox.connect('nosuchsandbox0'), NotFoundError)
    await assert.rejects(Sandbox.getInfo('nosuchsandbox0'), SandboxNotFoundError)
    // Another owner's key sees nothing of this sandbox.
    const other = { apiKey: OTHER_KEY }
    await assert.rejects(Sandbox.getInfo(sb.sandboxId, other), SandboxNotFoundError)
    await assert.rejects(Sandbox.connect(sb.sandboxId, other), NotFoundError)
    assert.equal(await Sandbox.kill(sb.sandboxId, other), false)
    await assert.rejects(Sandbox.setTimeout(sb.sandboxId, 10_000, other), NotFoundError)
    const theirs = await Sandbox.list({ ...other, query: { metadata: { kind: 'mine' } } }).nextItems()
    assert.deepEqual(theirs, [])
    assert.equal(await sb.isRunning(), true)
  }, { metadata: { kind: 'mine' } }))

test('a bad API key is an AuthenticationError', async () => {
  const bad = { apiKey: 'e2b_' + '0'.repeat(40) }
  await assert.rejects(Sandbox.create(bad), AuthenticationError)
  await assert.rejects(Sandbox.list(bad).nextItems(), AuthenticationError)
  await assert.rejects(Sandbox.getInfo('nosuchsandbox0', bad), AuthenticationError)
})

test('metrics answer samples with dates, within start and end', () =>
  withSandbox(async (sb) => {
    const metrics = await waitFor('a sample', async () => {
      const m = await sb.getMetrics()
      return m.length > 0 && m
    }, { timeoutMs: 15_000, intervalMs: 250 })
    const m = metrics[0]
    assert.ok(m.timestamp instanceof Date && !Number.isNaN(m.timestamp.getTime()), m.timestamp)
    assert.ok(m.memTotal > 0 && m.cpuCount > 0, JSON.stringify(m))
    const future = new Date(Date.now() + 3_600_000)
    assert.deepEqual(await Sandbox.getMetrics(sb.sandboxId, { start: future, end: new Date(future.getTime() + 1_000) }), [])
    await assert.rejects(Sandbox.getMetrics(sb.sandboxId, { apiKey: OTHER_KEY }), NotFoundError)
  }))

test('updateNetwork replaces the egress rules of a running sandbox', () =>
  withSandbox(async (sb) => {
    await sb.updateNetwork({ denyOut: ['10.0.0.0/8'] })
    assert.deepEqual((await sb.getInfo()).network?.denyOut, ['10.0.0.0/8'])
    await sb.updateNetwork({})
    assert.deepEqual((await sb.getInfo()).network?.denyOut ?? [], [])
    await assert.rejects(sb.updateNetwork({ denyOut: ['not an address'] }), (e) => e instanceof SandboxError && e.statusCode === 400)
    await assert.rejects(Sandbox.updateNetwork(sb.sandboxId, {}, { apiKey: OTHER_KEY }), NotFoundError)
  }))
