// Templates through the SDK's `Template` builder: `Template.build` (files
// uploaded to signed URLs, steps, start and ready commands) and a sandbox
// from the result, `buildInBackground` with `getBuildStatus`, tags, a
// failed build's `BuildError`, and another key seeing none of it.
import assert from 'node:assert/strict'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { test } from 'node:test'
import { BuildError, Sandbox, Template } from 'e2b'
import { OTHER_KEY, waitFor, withSandbox } from './helpers.mjs'

test('Template.build, a sandbox from it, background builds, tags, another key', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'he2b-js-ctx-'))
  try {
    fs.writeFileSync(path.join(dir, 'hello.txt'), 'from js\n')
    const template = Template({ fileContextPath: dir })
      .fromBaseImage()
      .copy('hello.txt', '/home/user/hello.txt')
      .runCmd('echo js-$(whoami) > /home/user/who')
      .setEnvs({ JS_MODE: 'on' })
      .setWorkdir('/home/user/work')
      .setStartCmd('pwd > /tmp/started; sleep infinity', 'test -s /tmp/started')
    const logs = []
    const info = await Template.build(template, 'js-app:v1', { onBuildLogs: (l) => logs.push(String(l.message)) })
    assert.match(info.templateId, /^tpl-/)
    assert.ok(logs.some((l) => l.includes("Uploaded 'hello.txt'")), logs.join('\n'))
    await withSandbox(async (sb) => {
      assert.equal(await sb.files.read('/home/user/hello.txt'), 'from js\n')
      assert.equal(await sb.files.read('/home/user/who'), 'js-user\n')
      assert.equal(await sb.files.read('/tmp/started'), '/home/user/work\n')
      assert.equal((await sb.commands.run('echo $JS_MODE')).stdout, 'on\n')
    }, 'js-app:v1')

    const child = Template().fromTemplate('js-app').runCmd('echo child > /home/user/child')
    const bg = await Template.buildInBackground(child, 'js-child')
    const done = await waitFor('the background build', async () => {
      const s = await Template.getBuildStatus(bg)
      return ['ready', 'error'].includes(s.status) ? s : null
    }, { timeoutMs: 300_000, intervalMs: 500 })
    assert.equal(done.status, 'ready', JSON.stringify(done))
    await withSandbox(async (sb) => {
      assert.equal(await sb.files.read('/home/user/hello.txt'), 'from js\n')
      assert.equal(await sb.files.read('/home/user/child'), 'child\n')
    }, 'js-child')

    assert.equal(await Template.exists('js-app'), true)
    const tagged = await Template.assignTags('js-app:v1', 'prod')
    assert.deepEqual(tagged.tags, ['prod'])
    assert.deepEqual((await Template.getTags('js-app')).map((t) => t.tag).sort(), ['prod', 'v1'])

    const other = { apiKey: OTHER_KEY }
    assert.equal(await Template.exists('js-app', other), false)
    await assert.rejects(Sandbox.create('js-app', other))
    await assert.rejects(Sandbox.create(info.templateId, other))
  } finally {
    fs.rmSync(dir, { recursive: true, force: true })
  }
})

test('a failed build rejects with BuildError and its reason', async () => {
  const failing = Template().fromBaseImage().runCmd('echo js-about-to-fail; exit 4')
  const logs = []
  await assert.rejects(
    Template.build(failing, 'js-fails', { onBuildLogs: (l) => logs.push(String(l.message)) }),
    (e) => e instanceof BuildError && /exit code 4/.test(e.message),
  )
  assert.ok(logs.some((l) => l.includes('js-about-to-fail')), logs.join('\n'))
})
