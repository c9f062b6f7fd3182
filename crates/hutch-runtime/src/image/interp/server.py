"""hutch's code interpreter server, run in sandboxes of the `code-interpreter`
image by the built-in template `code-interpreter-v1`.

It speaks the protocol of E2B's `e2b-code-interpreter` SDK on
127.0.0.1:49999 (the daemon reaches it through the sandbox's network
namespace; nothing else outside the sandbox can):

- `GET /health`
- `POST /execute` `{"code", "context_id"?, "language"?, "env_vars"?}`:
  a stream of JSON lines (`number_of_executions`, `stdout`, `stderr`,
  `result`, `error`, `keepalive`, then `end_of_execution`);
- `GET /contexts`, `POST /contexts` `{"language"?, "cwd"?}`,
  `POST /contexts/{id}/restart`, `DELETE /contexts/{id}`.

Python runs in IPython kernels (ipykernel, driven through jupyter_client),
JavaScript in Node processes running jsrunner.js next to this file. A
context runs one execution at a time; others wait their turn. A client
that goes away interrupts its execution (SIGINT), which then runs to its
end unobserved, so the next one finds the context idle.

Written for hutch from the SDK's side of the protocol; only the standard
library and jupyter_client are used.
"""

import asyncio
import datetime
import json
import os
import queue
import signal
import sys
import uuid

HOST = "127.0.0.1"
PORT = 49999
HERE = os.path.dirname(os.path.abspath(__file__))
JS_RUNNER = os.path.join(HERE, "jsrunner.js")
NODE = "/usr/bin/node"
PYTHON_KERNEL = "hutch-python"
DEFAULT_CWD = "/home/user"

# Bounds on what a client may send.
MAX_LINE = 64 * 1024
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY = 16 * 1024 * 1024
MAX_CONTEXTS = 64
# Between two keepalive lines of a quiet execution.
KEEPALIVE = 5.0
KERNEL_START_TIMEOUT = 60.0
# How long an interrupted or abandoned execution may take to end before
# its context is restarted.
SETTLE_TIMEOUT = 30.0

LANGUAGES = {"python": "python", "py": "python", "javascript": "javascript", "js": "javascript"}

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def log(*args):
    print("hutch-interp:", *args, file=sys.stderr, flush=True)


class HttpError(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def iso(date):
    if isinstance(date, datetime.datetime):
        return date.isoformat()
    return str(date) if date else now_iso()


def plain_text(text):
    """As E2B shows it: a quoted string's repr shows as the string."""
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def result_event(data, main):
    """A display bundle as the SDK's `Result`: the well-known MIME types
    under their short names, the rest in `extra`."""
    data = dict(data)
    event = {"type": "result", "is_main_result": main}
    text = data.pop("text/plain", None)
    if text is not None:
        event["text"] = plain_text(text)
    for mime, key in (
        ("text/html", "html"),
        ("text/markdown", "markdown"),
        ("image/svg+xml", "svg"),
        ("image/png", "png"),
        ("image/jpeg", "jpeg"),
        ("application/pdf", "pdf"),
        ("text/latex", "latex"),
        ("application/json", "json"),
        ("application/javascript", "javascript"),
        ("e2b/data", "data"),
        ("e2b/chart", "chart"),
    ):
        if mime in data:
            event[key] = data.pop(mime)
    if data:
        event["extra"] = data
    return event


def error_event(name, value, traceback=""):
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


def base_env():
    env = dict(os.environ)
    # Quiet start-up warnings of the kernel's own libraries.
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    return env


# The sandbox's environment as the server started with it: what an
# execution's own `env_vars` fall back to when it ends.
GLOBAL_ENV = dict(os.environ)


class Execution:
    """One `/execute` call: its events, and whether its client left."""

    def __init__(self):
        self.events = asyncio.Queue(maxsize=256)
        self.abandoned = False
        self.started = False

    async def put(self, event):
        if not self.abandoned:
            await self.events.put(event)

    def abandon(self):
        self.abandoned = True
        # Unblock a producer waiting for room.
        while not self.events.empty():
            self.events.get_nowait()


class Context:
    language = ""

    def __init__(self, cid, cwd):
        self.id = cid
        self.cwd = cwd
        self.lock = asyncio.Lock()
        # Raised by a restart or a removal: a running execution ends.
        self.generation = 0
        self.removed = False

    def view(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def run_with_env(self, code, env_vars, exe):
        """Runs `code` with `env_vars` set for its duration."""
        if env_vars:
            ok = True
            async for event in self.run(self.set_env_code(env_vars), silent=True):
                if event["type"] == "error":
                    ok = False
                    await exe.put(event)
            if not ok:
                return
        try:
            async for event in self.run(code, silent=False):
                await exe.put(event)
        finally:
            if env_vars and not self.removed:
                restore = {k: GLOBAL_ENV.get(k) for k in env_vars}
                async for _ in self.run(self.restore_env_code(restore), silent=True):
                    pass


class PythonContext(Context):
    language = "python"

    def __init__(self, cid, cwd):
        super().__init__(cid, cwd)
        self.km = None
        self.kc = None

    async def start(self):
        from jupyter_client.manager import AsyncKernelManager

        self.km = AsyncKernelManager(kernel_name=PYTHON_KERNEL)
        await self.km.start_kernel(
            cwd=self.cwd, env=base_env(), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=KERNEL_START_TIMEOUT)

    @staticmethod
    def set_env_code(env):
        return f"(lambda e: e.update({env!r}))(__import__('os').environ)"

    @staticmethod
    def restore_env_code(restore):
        keep = {k: v for k, v in restore.items() if v is not None}
        drop = [k for k, v in restore.items() if v is None]
        return f"(lambda e: (e.update({keep!r}), [e.pop(k, None) for k in {drop!r}]))(__import__('os').environ)"

    async def run(self, code, silent):
        generation = self.generation
        msg_id = self.kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False, stop_on_error=True)
        while True:
            if self.generation != generation:
                yield error_event("ContextRestarting", "Context was restarted")
                return
            try:
                msg = await self.kc.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                if not await self.km.is_alive():
                    yield error_event("ContextRestarting", "Context was restarted: its kernel died")
                    await self.recover()
                    return
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status":
                if content.get("execution_state") == "idle":
                    break
            elif kind == "stream":
                name = "stderr" if content.get("name") == "stderr" else "stdout"
                yield {"type": name, "text": content.get("text", ""), "timestamp": iso(msg["header"].get("date"))}
            elif kind == "execute_input":
                if not silent:
                    yield {"type": "number_of_executions", "execution_count": content.get("execution_count")}
            elif kind == "execute_result":
                yield result_event(content.get("data", {}), True)
            elif kind in ("display_data", "update_display_data"):
                yield result_event(content.get("data", {}), False)
            elif kind == "error":
                yield error_event(
                    content.get("ename", ""), content.get("evalue", ""), "\n".join(content.get("traceback", []))
                )
        reply = await self.reply_to(msg_id)
        if reply is not None and reply.get("status") == "aborted":
            yield error_event("ExecutionAborted", "Execution was aborted")

    async def reply_to(self, msg_id):
        """The shell reply of `msg_id` (older replies are dropped)."""
        try:
            while True:
                msg = await self.kc.get_shell_msg(timeout=5.0)
                if msg.get("parent_header", {}).get("msg_id") == msg_id:
                    return msg["content"]
        except queue.Empty:
            return None

    async def interrupt(self):
        await self.km.interrupt_kernel()

    async def recover(self):
        """A kernel that died comes back empty."""
        self.generation += 1
        await self.km.restart_kernel(now=True)
        await self.kc.wait_for_ready(timeout=KERNEL_START_TIMEOUT)

    async def restart(self):
        self.generation += 1
        await self.km.restart_kernel(now=True)
        await self.kc.wait_for_ready(timeout=KERNEL_START_TIMEOUT)

    async def shutdown(self):
        self.generation += 1
        self.removed = True
        try:
            self.kc.stop_channels()
        finally:
            await self.km.shutdown_kernel(now=True)


class JsContext(Context):
    """A Node process running jsrunner.js: requests go in on one pipe,
    events come back on another (JSON lines); what the process and its
    children write to fd 1 and 2 is the running execution's output."""

    language = "javascript"
    # Queued events of an execution before the runner's pipes are no
    # longer read (the client reads slower than the code writes).
    QUEUE = 256

    def __init__(self, cid, cwd):
        super().__init__(cid, cwd)
        self.proc = None
        self.requests = None
        self.current = None
        self.waiter = None
        self.backlog = []
        self.raw_fds = {}
        self.ready = None
        self.reader = None
        self.count = 0

    async def start(self):
        loop = asyncio.get_running_loop()
        req_r, req_w = os.pipe()
        ev_r, ev_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        env = base_env()
        env["HUTCH_IN_FD"], env["HUTCH_OUT_FD"] = str(req_r), str(ev_w)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                NODE,
                "--expose-internals",
                JS_RUNNER,
                cwd=self.cwd,
                env=env,
                pass_fds=(req_r, ev_w),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                start_new_session=True,
            )
        except BaseException:
            for fd in (req_w, ev_r, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (req_r, ev_w, out_w, err_w):
                os.close(fd)
        self.requests = os.fdopen(req_w, "wb", buffering=0)
        events = asyncio.StreamReader(limit=256 * 1024 * 1024)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(events), os.fdopen(ev_r, "rb", buffering=0))
        self.raw_fds = {out_r: "stdout", err_r: "stderr"}
        for fd in self.raw_fds:
            os.set_blocking(fd, False)
            loop.add_reader(fd, self.pull, fd)
        self.ready = loop.create_future()
        self.reader = asyncio.create_task(self.read_events(events))
        await asyncio.wait_for(asyncio.shield(self.ready), KERNEL_START_TIMEOUT)

    def send(self, request):
        self.requests.write((json.dumps(request) + "\n").encode())

    def deliver(self, event):
        """Hands an event to the running execution; past the queue's
        bound it waits in the backlog and the raw pipes are not read."""
        if self.waiter is None:
            return
        if self.backlog or self.waiter.full():
            self.backlog.append(event)
            loop = asyncio.get_running_loop()
            for fd in self.raw_fds:
                loop.remove_reader(fd)
        else:
            self.waiter.put_nowait(event)

    def refill(self):
        while self.backlog and self.waiter is not None and not self.waiter.full():
            self.waiter.put_nowait(self.backlog.pop(0))
        if not self.backlog:
            loop = asyncio.get_running_loop()
            for fd in self.raw_fds:
                loop.add_reader(fd, self.pull, fd)

    def pull(self, fd):
        """Reads what fd 1 or 2 of the runner holds now."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                asyncio.get_running_loop().remove_reader(fd)
                return
            self.deliver({"type": self.raw_fds[fd], "text": chunk.decode("utf-8", "replace"), "timestamp": now_iso()})
            if self.backlog:
                return

    async def read_events(self, events):
        try:
            while True:
                line = await events.readline()
                if not line:
                    break
                event = json.loads(line)
                if event.get("type") == "ready":
                    if not self.ready.done():
                        self.ready.set_result(True)
                    continue
                if event.pop("id", None) != self.current:
                    continue
                if event.get("type") == "done":
                    # Output a child wrote before the runner finished is in
                    # the pipes now: it goes first.
                    for fd in self.raw_fds:
                        self.pull(fd)
                self.deliver(event)
                while self.backlog:
                    await asyncio.sleep(0.01)
        except Exception as e:  # a broken runner ends its execution below
            log(f"javascript context {self.id}: {e}")
        finally:
            if not self.ready.done():
                self.ready.set_exception(RuntimeError("the javascript runner exited"))
            self.deliver({"type": "exit"})

    @staticmethod
    def set_env_code(env):
        return {"op": "env", "set": env}

    @staticmethod
    def restore_env_code(restore):
        return {"op": "env", "set": restore}

    async def run(self, code, silent):
        generation = self.generation
        rid = str(uuid.uuid4())
        if isinstance(code, dict):
            request = dict(code, id=rid)
        else:
            request = {"op": "execute", "id": rid, "code": code}
            self.count += 1
            yield {"type": "number_of_executions", "execution_count": self.count}
        self.waiter = asyncio.Queue(maxsize=self.QUEUE)
        self.backlog = []
        self.current = rid
        try:
            try:
                self.send(request)
            except (OSError, ValueError):
                yield error_event("ContextRestarting", "Context was restarted: its runner exited")
                return
            while True:
                try:
                    event = await asyncio.wait_for(self.waiter.get(), 1.0)
                except asyncio.TimeoutError:
                    if self.generation != generation:
                        yield error_event("ContextRestarting", "Context was restarted")
                        return
                    continue
                self.refill()
                kind = event.get("type")
                if kind == "done":
                    return
                if kind == "exit":
                    if self.generation == generation and not self.removed:
                        yield error_event("ContextRestarting", "Context was restarted: its runner exited")
                        await self.recover()
                    else:
                        yield error_event("ContextRestarting", "Context was restarted")
                    return
                if kind == "result":
                    yield {"type": "result", "is_main_result": True, "text": plain_text(event.get("text", ""))}
                elif kind in ("stdout", "stderr"):
                    event.setdefault("timestamp", now_iso())
                    yield event
                elif kind == "error":
                    yield error_event(event.get("name", "Error"), event.get("value", ""), event.get("traceback", ""))
        finally:
            if self.current == rid:
                self.current = None
                self.waiter = None
                self.backlog = []

    async def interrupt(self):
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)

    async def stop(self):
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for fd in self.raw_fds:
            loop.remove_reader(fd)
            os.close(fd)
        self.raw_fds = {}
        if self.requests is not None:
            try:
                self.requests.close()
            except OSError:
                pass

    async def recover(self):
        self.generation += 1
        await self.stop()
        await self.start()

    async def restart(self):
        await self.recover()

    async def shutdown(self):
        self.generation += 1
        self.removed = True
        await self.stop()


class Contexts:
    def __init__(self):
        self.by_id = {}
        # Language -> id of its default context (made on first use).
        self.defaults = {}
        self.default_locks = {lang: asyncio.Lock() for lang in set(LANGUAGES.values())}

    async def create(self, language, cwd):
        if len(self.by_id) >= MAX_CONTEXTS:
            raise HttpError(429, f"at most {MAX_CONTEXTS} contexts; remove one first")
        cls = PythonContext if language == "python" else JsContext
        ctx = cls(str(uuid.uuid4()), cwd)
        try:
            await ctx.start()
        except Exception as e:
            try:
                await ctx.shutdown()
            except Exception:
                pass
            raise HttpError(500, f"the {language} context did not start: {e}")
        self.by_id[ctx.id] = ctx
        return ctx

    async def default(self, language):
        async with self.default_locks[language]:
            cid = self.defaults.get(language)
            if cid in self.by_id:
                return self.by_id[cid]
            ctx = await self.create(language, DEFAULT_CWD)
            self.defaults[language] = ctx.id
            return ctx

    def get(self, cid):
        ctx = self.by_id.get(cid)
        if ctx is None:
            raise HttpError(404, f"Context {cid} not found")
        return ctx

    async def remove(self, cid):
        ctx = self.get(cid)
        del self.by_id[cid]
        await ctx.shutdown()


CONTEXTS = None


def language_of(value):
    if value is None or value == "":
        return "python"
    if not isinstance(value, str):
        raise HttpError(400, "language must be a string")
    lang = LANGUAGES.get(value.strip().lower())
    if lang is None:
        raise HttpError(400, f"language {value!r} is not supported here (python, javascript)")
    return lang


def json_body(req):
    if not req.body:
        return {}
    try:
        body = json.loads(req.body)
    except ValueError as e:
        raise HttpError(400, f"the body is not JSON: {e}")
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


def check_cwd(cwd):
    if cwd is None:
        return DEFAULT_CWD
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd:
        raise HttpError(400, "cwd must be an absolute path")
    if not os.path.isdir(cwd) or not os.access(cwd, os.X_OK):
        raise HttpError(400, f"cwd {cwd} is not a directory this user may enter")
    return cwd


def check_env(env):
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise HttpError(400, "env_vars must map strings to strings")
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise HttpError(400, f"env_vars: {k!r} is not a valid variable")
    return env


class Request:
    def __init__(self, method, path, headers, body):
        self.method, self.path, self.headers, self.body = method, path, headers, body


async def read_request(reader):
    """One request, or None at the end of the connection."""
    try:
        line = await reader.readline()
    except ValueError:
        raise HttpError(431, "request line too long")
    if not line:
        return None
    parts = line.decode("latin-1").rstrip("\r\n").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "malformed request line")
    method, target, _ = parts
    headers, total = {}, 0
    while True:
        try:
            h = await reader.readline()
        except ValueError:
            raise HttpError(431, "header line too long")
        total += len(h)
        if total > MAX_HEADER_BYTES:
            raise HttpError(431, "headers too large")
        if h in (b"\r\n", b"\n"):
            break
        if not h:
            return None
        name, sep, value = h.decode("latin-1").partition(":")
        if not sep:
            raise HttpError(400, "malformed header")
        headers[name.strip().lower()] = value.strip()
    body = b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        size = 0
        while True:
            try:
                n = int((await reader.readline()).split(b";")[0].strip(), 16)
            except ValueError:
                raise HttpError(400, "malformed chunk")
            size += n
            if size > MAX_BODY:
                raise HttpError(413, f"body above {MAX_BODY} bytes")
            if n == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                break
            chunks.append(await reader.readexactly(n))
            await reader.readline()
        body = b"".join(chunks)
    elif "content-length" in headers:
        try:
            n = int(headers["content-length"])
        except ValueError:
            raise HttpError(400, "malformed Content-Length")
        if n < 0 or n > MAX_BODY:
            raise HttpError(413, f"body above {MAX_BODY} bytes")
        body = await reader.readexactly(n)
    path = target.split("?", 1)[0]
    return Request(method, path, headers, body)


def head(status, headers):
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def send(writer, status, body, content_type="application/json", close=False):
    if isinstance(body, str):
        body = body.encode()
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
    if close:
        headers.append(("Connection", "close"))
    writer.write(head(status, headers) + body)
    await writer.drain()


async def send_json(writer, status, value):
    await send(writer, status, json.dumps(value))


async def execute(req, reader, writer):
    body = json_body(req)
    code = body.get("code")
    if not isinstance(code, str):
        raise HttpError(400, "code must be a string")
    cid, language = body.get("context_id"), body.get("language")
    if cid and language:
        raise HttpError(400, "Only one of context_id or language can be provided")
    env_vars = check_env(body.get("env_vars"))
    if cid:
        if not isinstance(cid, str):
            raise HttpError(400, "context_id must be a string")
        ctx = CONTEXTS.get(cid)
    else:
        ctx = await CONTEXTS.default(language_of(language))

    exe = Execution()
    task = asyncio.create_task(run_execution(ctx, code, env_vars, exe))
    writer.write(
        head(200, [("Content-Type", "application/x-ndjson"), ("Transfer-Encoding", "chunked"), ("Cache-Control", "no-store")])
    )
    eof = asyncio.ensure_future(reader.read(1))
    gone = False
    try:
        while True:
            get = asyncio.ensure_future(exe.events.get())
            done, _ = await asyncio.wait({get, eof}, timeout=KEEPALIVE, return_when=asyncio.FIRST_COMPLETED)
            if eof in done and get not in done:
                get.cancel()
                gone = True
                break
            if get not in done:
                get.cancel()
                event = {"type": "keepalive"}
            else:
                event = get.result()
            if event is None:
                event = {"type": "end_of_execution"}
            data = (json.dumps(event) + "\n").encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            if event["type"] == "end_of_execution":
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                break
    except (ConnectionError, asyncio.CancelledError):
        gone = True
        raise
    finally:
        if gone:
            exe.abandon()
            if exe.started and not task.done():
                try:
                    await ctx.interrupt()
                except Exception as e:
                    log(f"interrupt of context {ctx.id}: {e}")
                asyncio.create_task(settle(ctx, task))
        if not eof.done():
            eof.cancel()
        await asyncio.gather(eof, return_exceptions=True)
    # Bytes that followed the request were read here, not parsed: the
    # connection closes.
    return not (not eof.cancelled() and eof.exception() is None and eof.result())


async def settle(ctx, task):
    """An interrupted execution that does not end in time (it caught the
    interrupt) has its context restarted, so later ones do not wait on it."""
    try:
        await asyncio.wait_for(asyncio.shield(task), SETTLE_TIMEOUT)
    except asyncio.TimeoutError:
        log(f"context {ctx.id}: an interrupted execution went on; restarting the context")
        try:
            await ctx.restart()
        except Exception as e:
            log(f"restart of context {ctx.id}: {e}")
    except Exception:
        pass


async def run_execution(ctx, code, env_vars, exe):
    try:
        async with ctx.lock:
            if exe.abandoned:
                return
            exe.started = True
            try:
                await ctx.run_with_env(code, env_vars, exe)
            except Exception as e:
                log(f"execution in context {ctx.id}: {e!r}")
                await exe.put(error_event("InternalError", "the code interpreter failed to run this code"))
    finally:
        await exe.put(None)


async def handle(req, reader, writer):
    """Serves one request; False when the connection must close."""
    path, method = req.path, req.method
    if path == "/health":
        if method != "GET":
            raise HttpError(405, "GET only")
        await send_json(writer, 200, "OK")
        return True
    if path == "/execute":
        if method != "POST":
            raise HttpError(405, "POST only")
        return await execute(req, reader, writer)
    if path == "/contexts":
        if method == "GET":
            await send_json(writer, 200, [c.view() for c in CONTEXTS.by_id.values()])
            return True
        if method == "POST":
            body = json_body(req)
            ctx = await CONTEXTS.create(language_of(body.get("language")), check_cwd(body.get("cwd")))
            await send_json(writer, 200, ctx.view())
            return True
        raise HttpError(405, "GET or POST")
    if path.startswith("/contexts/"):
        rest = path[len("/contexts/") :]
        if rest.endswith("/restart"):
            if method != "POST":
                raise HttpError(405, "POST only")
            ctx = CONTEXTS.get(rest[: -len("/restart")])
            try:
                await ctx.restart()
            except Exception as e:
                raise HttpError(500, f"Failed to restart context {ctx.id}: {e}")
            await send_json(writer, 200, None)
            return True
        if "/" not in rest:
            if method != "DELETE":
                raise HttpError(405, "DELETE only")
            await CONTEXTS.remove(rest)
            await send_json(writer, 200, None)
            return True
    raise HttpError(404, f"no route {path}")


async def connection(reader, writer):
    try:
        while True:
            try:
                req = await read_request(reader)
                if req is None:
                    break
                if not await handle(req, reader, writer):
                    break
                if req.headers.get("connection", "").lower() == "close":
                    break
            except HttpError as e:
                await send(writer, e.status, e.message, "text/plain; charset=utf-8", close=True)
                break
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    except Exception as e:
        log(f"request failed: {e!r}")
        try:
            await send(writer, 500, "internal error", "text/plain; charset=utf-8", close=True)
        except Exception:
            pass
    finally:
        writer.close()


async def main():
    global CONTEXTS
    CONTEXTS = Contexts()
    # The default python context starts before the server listens: the
    # template's readiness check (this port) then means a kernel is up, so
    # a warm pool's sandboxes answer their first call at once. A kernel
    # that fails to start is retried by the first execution, which reports
    # the error.
    try:
        await CONTEXTS.default("python")
    except Exception as e:
        log(f"the default python context did not start: {e}")
    server = await asyncio.start_server(connection, HOST, PORT, limit=MAX_LINE)
    log(f"listening on {HOST}:{PORT}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    for ctx in list(CONTEXTS.by_id.values()):
        try:
            await ctx.shutdown()
        except Exception:
            pass


if __name__ == "__main__":
    try:
        os.chdir(DEFAULT_CWD)
    except OSError:
        pass
    asyncio.run(main())
