"""The sync client's path for small calls: http.client on keep-alive connections.

A call whose body is in memory and whose answer is read whole (a command,
a create, a read of a sandbox: most calls) is sent with the standard
library's http.client, which costs a third of what httpx, httpcore and h11
spend on the same request. Streams, uploads and downloads, https, proxies
and a client passed in (`http_client=`) go through httpx as before.

Failures are raised as the httpx exceptions the retry rule (`retry_delay`)
reads: a connection that could not be made is `ConnectError` /
`ConnectTimeout`; one that broke while the request was sent or the answer
read is `WriteError` / `ReadError` / `RemoteProtocolError` (the call may
have run); no answer in time is `ReadTimeout`.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
from typing import Dict, List, Mapping, Optional
from urllib.parse import urlencode, urlsplit

import httpx

from ._core import ERROR_BODY_CAP, Reply

#: Idle connections kept for reuse.
KEEP = 20


class FastHttp:
    def __init__(self, base_url: str, headers: Mapping[str, str], connect_timeout: float):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError("the fast path serves http:// only")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self.headers = dict(headers)
        self.connect_timeout = connect_timeout
        self._idle: List[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    @staticmethod
    def serves(base_url: str) -> bool:
        u = urlsplit(base_url)
        return u.scheme == "http" and bool(u.hostname) and not u.query and not u.fragment

    def _take(self) -> Optional[http.client.HTTPConnection]:
        """An idle connection the daemon has not closed (nothing to read on
        an idle connection but its end), or None."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn = self._idle.pop()
            sock = conn.sock
            try:
                if sock is not None and not select.select([sock], [], [], 0)[0]:
                    return conn
            except (OSError, ValueError):
                pass
            conn.close()

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < KEEP:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout)
        try:
            conn.connect()  # sets TCP_NODELAY
        except socket.timeout as e:
            conn.close()
            raise httpx.ConnectTimeout(f"connect to {self.host}:{self.port}: {e}") from e
        except OSError as e:
            conn.close()
            raise httpx.ConnectError(f"connect to {self.host}:{self.port}: {e}") from e
        return conn

    def request(self, method: str, path: str, params: Optional[Mapping[str, str]], headers: Mapping[str, str],
                body: Optional[bytes], read_timeout: Optional[float]) -> Reply:
        target = self.prefix + path
        if params:
            target += "?" + urlencode(params)
        h = dict(self.headers)
        h.update(headers)
        conn = self._take() or self._connect()
        ok = False
        try:
            sock = conn.sock
            assert sock is not None
            sock.settimeout(self.connect_timeout)
            try:
                conn.request(method, target, body=body, headers=h)
            except socket.timeout as e:
                raise httpx.WriteTimeout(f"{method} {path}: sending: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                raise httpx.WriteError(f"{method} {path}: sending: {e}") from e
            sock.settimeout(read_timeout)
            try:
                resp = conn.getresponse()
                if resp.status >= 400:
                    content = resp.read(ERROR_BODY_CAP)
                else:
                    content = resp.read()
            except socket.timeout as e:
                raise httpx.ReadTimeout(f"{method} {path}: no answer in time: {e}") from e
            except http.client.RemoteDisconnected as e:
                raise httpx.RemoteProtocolError(f"{method} {path}: the connection closed: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                raise httpx.ReadError(f"{method} {path}: reading the answer: {e}") from e
            ok = resp.isclosed() and not resp.will_close
            return Reply(resp.status, _headers(resp.headers), content)
        finally:
            if ok:
                self._give(conn)
            else:
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _headers(message: "http.client.HTTPMessage") -> Dict[str, str]:
    return {k.lower(): v for k, v in message.items()}
