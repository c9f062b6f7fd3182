// Sandbox state through the JavaScript SDK: pause to disk
// (`keepMemory: false`) and connect resuming it, snapshots (create, list,
// create a sandbox from one, delete), fork, and another key's refusals.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { NotFoundError, Sandbox } from 'e2b'
import { OTHER_KEY, withSandbox } from './helpers.mjs'

test('pause with keepMemory false keeps files, and connect resumes it', () =>
  withSandbox(async (sb) => {
    await sb.files.write('kept.txt', 'on disk')
    await sb.commands.run('sleep 300', { background: true })
    assert.equal(await sb.pause({ keepMemory: false }), true)
    assert.equal(await sb.isRunning(), false)
    assert.equal(await sb.pause({ keepMemory: false }), false)
    const back = await Sandbox.connect(sb.sandboxId)
    assert.equal(await back.files.read('kept.txt'), 'on disk')
    assert.ok(!(await back.commands.run('ps -eo args')).stdout.includes('sleep 300'))
  }))

test('snapshots: create, list, start a sandbox from one, delete', () =>
  withSandbox(async (sb) => {
    await sb.files.write('state.txt', 'v1')
    const snap = await sb.createSnapshot({ name: 'js-snap' })
    assert.ok(snap.snapshotId.startsWith('snap-'), snap.snapshotId)
    assert.deepEqual(snap.names, ['js-snap'])
    const listed = await Sandbox.listSnapshots({ sandboxId: sb.sandboxId }).nextItems()
    assert.deepEqual(listed.map((s) => s.snapshotId), [snap.snapshotId])
    const other = await Sandbox.listSnapshots({ apiKey: OTHER_KEY }).nextItems()
    assert.ok(!other.some((s) => s.snapshotId === snap.snapshotId))
    const child = await Sandbox.create(snap.snapshotId)
    try {
      assert.equal(await child.files.read('state.txt'), 'v1')
    } finally {
      await child.kill()
    }
    await assert.rejects(Sandbox.create(snap.snapshotId, { apiKey: OTHER_KEY }))
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, { apiKey: OTHER_KEY }), false)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
  }))

test('fork starts sandboxes holding the parent files', () =>
  withSandbox(async (sb) => {
    await sb.files.write('fork.txt', 'parent')
    const forks = await sb.fork({ count: 2 })
    try {
      assert.equal(forks.length, 2)
      for (const f of forks) {
        assert.ok(f instanceof Sandbox, String(f))
        assert.notEqual(f.sandboxId, sb.sandboxId)
        assert.equal(await f.files.read('fork.txt'), 'parent')
      }
    } finally {
      for (const f of forks) if (f instanceof Sandbox) await f.kill()
    }
    await assert.rejects(Sandbox.fork(sb.sandboxId, { count: 1, apiKey: OTHER_KEY }), NotFoundError)
  }))
