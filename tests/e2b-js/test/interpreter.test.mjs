// The unmodified `@e2b/code-interpreter` JavaScript SDK against hutch's
// built-in `code-interpreter-v1` template (its image is built before this
// suite runs: tests/e2b/test_js.py asks for it): runCode with state kept
// between calls, stdout/stderr callbacks, errors with tracebacks, rich
// results, per-run envs, timeouts, contexts (create, list, restart,
// remove) and JavaScript.
import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'
import { Sandbox } from '@e2b/code-interpreter'

const PNG_MAGIC = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])

let sb
before(async () => {
  sb = await Sandbox.create({ envs: { SANDBOX_VAR: 'from-create' }, timeoutMs: 600_000 })
})
after(async () => {
  await sb?.kill().catch(() => {})
})

test('runCode returns the value and keeps state between calls', async () => {
  assert.equal((await sb.runCode('x = 41')).error, undefined)
  const ex = await sb.runCode('x + 1')
  assert.equal(ex.text, '42')
  assert.equal(ex.results.length, 1)
  assert.equal(ex.results[0].isMainResult, true)
})

test('stdout and stderr reach the callbacks and the logs', async () => {
  const out = []
  const err = []
  const ex = await sb.runCode("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n'done'", {
    onStdout: (m) => out.push(m),
    onStderr: (m) => err.push(m),
  })
  assert.deepEqual(ex.logs.stdout, ['to out\n'])
  assert.deepEqual(ex.logs.stderr, ['to err\n'])
  assert.deepEqual(out.map((m) => [m.line, m.error]), [['to out\n', false]])
  assert.deepEqual(err.map((m) => [m.line, m.error]), [['to err\n', true]])
  assert.equal(ex.text, 'done')
})

test('an error carries its name, value and traceback', async () => {
  const seen = []
  const ex = await sb.runCode('def f():\n    return 1 / 0\nf()', { onError: (e) => seen.push(e) })
  assert.ok(ex.error)
  assert.deepEqual([ex.error.name, ex.error.value], ['ZeroDivisionError', 'division by zero'])
  assert.match(ex.error.traceback, /return 1 \/ 0/)
  assert.deepEqual(seen.map((e) => e.name), ['ZeroDivisionError'])
  assert.equal((await sb.runCode("'still here'")).text, 'still here')
})

test('rich results: HTML, a PNG chart, a dataframe', async () => {
  let ex = await sb.runCode("from IPython.display import HTML\nHTML('<b>bold</b>')")
  assert.equal(ex.results[0].html, '<b>bold</b>')
  ex = await sb.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()')
  assert.equal(ex.error, undefined)
  const charts = ex.results.filter((r) => r.png)
  assert.equal(charts.length, 1)
  assert.ok(Buffer.from(charts[0].png, 'base64').subarray(0, 8).equals(PNG_MAGIC))
  ex = await sb.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
  assert.equal(ex.error, undefined)
  assert.match(ex.results[0].html, /<table/)
})

test("envs of the sandbox and of one run; a run's end with it", async () => {
  const code = "import os\n(os.environ.get('SANDBOX_VAR'), os.environ.get('RUN_VAR'))"
  assert.equal((await sb.runCode(code)).text, "('from-create', None)")
  assert.equal((await sb.runCode(code, { envs: { RUN_VAR: 'once' } })).text, "('from-create', 'once')")
  assert.equal((await sb.runCode(code)).text, "('from-create', None)")
})

test('a timeout rejects and the context runs the next call', async () => {
  await sb.runCode("timed = 'before'")
  await assert.rejects(sb.runCode('import time\nwhile True:\n    time.sleep(0.1)', { timeoutMs: 2_000 }))
  assert.equal((await sb.runCode('timed')).text, 'before')
})

test('contexts keep their own state, restart and go', async () => {
  const ctx = await sb.createCodeContext({ cwd: '/tmp' })
  assert.deepEqual([ctx.language, ctx.cwd], ['python', '/tmp'])
  assert.equal((await sb.runCode('import os\nos.getcwd()', { context: ctx })).text, '/tmp')
  await sb.runCode("mine = 'ctx'", { context: ctx })
  assert.equal((await sb.runCode("'mine' in dir()")).text, 'False')
  assert.ok((await sb.listCodeContexts()).some((c) => c.id === ctx.id))
  await sb.restartCodeContext(ctx)
  const ex = await sb.runCode('mine', { context: ctx })
  assert.equal(ex.error?.name, 'NameError')
  await sb.removeCodeContext(ctx)
  assert.ok(!(await sb.listCodeContexts()).some((c) => c.id === ctx.id))
  await assert.rejects(sb.runCode('1', { context: ctx }))
})

test('JavaScript keeps state, streams output and reports errors', async () => {
  const ctx = await sb.createCodeContext({ language: 'javascript' })
  assert.equal(ctx.language, 'javascript')
  const out = []
  const ex = await sb.runCode("let n = 20; console.log('js out'); n * 2", {
    context: ctx,
    onStdout: (m) => out.push(m.line),
  })
  assert.equal(ex.error, undefined)
  assert.equal(ex.text, '40')
  assert.deepEqual(out, ['js out\n'])
  assert.equal((await sb.runCode('n + 1', { context: ctx })).text, '21')
  const bad = await sb.runCode("throw new TypeError('boom')", { context: ctx })
  assert.deepEqual([bad.error?.name, bad.error?.value], ['TypeError', 'boom'])
  await sb.removeCodeContext(ctx)
})
