"""A small application run inside a sandbox by test_proxy.py and
bench/proxy_bench.py (standard library only: the `base` image has the
host's python3).

    python3 proxy_app.py PORT [BIND]

Routes:
  GET  /headers      -> {"path", "method", "headers": [[name, value], ...]}
  POST /echo         -> the request body, streamed back
  GET  /sse          -> text/event-stream, one event every 100 ms, forever
  GET  /ws           -> a WebSocket echo (text and binary frames)
  GET  /set-headers  -> a response with CSP, Cache-Control, Clear-Site-Data
                        and cookies, one of them named like hutch's cookie
  GET  /set-nameless -> cookies without a name whose value reads as hutch's
                        cookie once a browser sends it back
  GET  /hello        -> "hello" (for the benchmark)
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import struct
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are separate writes: without TCP_NODELAY, Nagle and
    # the client's delayed ACK add 40 ms to every keep-alive response.
    disable_nagle_algorithm = True

    def log_message(self, *args) -> None:
        pass

    def send_body(self, status: int, body: bytes, ctype: str = "application/json", extra=()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/hello":
            self.send_body(200, b"hello", "text/plain")
        elif path == "/sse":
            self.sse()
        elif path == "/ws":
            self.websocket()
        elif path == "/set-nameless":
            self.send_body(200, b"{}", extra=[
                ("Set-Cookie", "=hutch_sandbox_token=forged; Path=/"),
                ("Set-Cookie", " = hutch_sandbox_token=forged2"),
                ("Set-Cookie", "=__Host-hutch_sandbox_token=forged3; Path=/; Secure"),
                ("Set-Cookie", "=app_nameless=kept"),
            ])
        elif path == "/set-headers":
            self.send_body(200, b"{}", extra=[
                ("Content-Security-Policy", "default-src 'self'"),
                ("Cache-Control", "public, max-age=3600"),
                ("Clear-Site-Data", '"cookies"'),
                ("Set-Cookie", "hutch_sandbox_token=forged; Path=/"),
                ("Set-Cookie", "app_session=abc; Path=/; HttpOnly"),
                ("X-App-Header", "kept"),
            ])
        else:
            self.headers_reply()

    def do_POST(self) -> None:
        if self.path.split("?")[0] == "/echo":
            n = int(self.headers.get("Content-Length") or 0)
            self.send_body(200, self.rfile.read(n), "application/octet-stream")
        else:
            self.headers_reply()

    def headers_reply(self) -> None:
        body = json.dumps({"path": self.path, "method": self.command, "headers": [[k, v] for k, v in self.headers.items()]})
        self.send_body(200, body.encode())

    def sse(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True
        n = 0
        try:
            while True:
                # Unframed: the connection's end ends the stream (HTTP/1.1 without a length).
                self.wfile.write(f"data: {n}\n\n".encode())
                self.wfile.flush()
                n += 1
                time.sleep(0.1)
        except OSError:
            return

    def websocket(self) -> None:
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        sock = self.connection
        try:
            while True:
                frame = read_frame(sock)
                if frame is None:
                    return
                opcode, payload = frame
                if opcode == 8:
                    send_frame(sock, 8, payload[:2])
                    return
                if opcode == 9:
                    send_frame(sock, 10, payload)
                elif opcode in (1, 2):
                    send_frame(sock, opcode, payload)
        except OSError:
            return


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    head = recv_exact(sock, 2)
    if head is None:
        return None
    opcode, length = head[0] & 0x0F, head[1] & 0x7F
    masked = head[1] & 0x80
    if length == 126:
        length = struct.unpack("!H", recv_exact(sock, 2) or b"\0\0")[0]
    elif length == 127:
        length = struct.unpack("!Q", recv_exact(sock, 8) or b"\0" * 8)[0]
    mask = recv_exact(sock, 4) if masked else b"\0\0\0\0"
    payload = recv_exact(sock, length) if length else b""
    if mask is None or payload is None:
        return None
    return opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def send_frame(sock: socket.socket, opcode: int, payload: bytes) -> None:
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    sock.sendall(head + payload)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, handler, family):
        self.address_family = family
        super().__init__(addr, handler)


def main() -> None:
    port = int(sys.argv[1])
    bind = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    Server((bind, port), Handler, family).serve_forever()


if __name__ == "__main__":
    main()
