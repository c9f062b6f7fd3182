"""Network instances for test daemons, shared by every test session on
this host.

A daemon's network instance N names its subnet, nftables table and host
links (`hutch serve --net-instance N`, 0 to 31). Test daemons take an
instance that no other live test daemon holds, through an exclusive
`flock` on a lock file per instance: two test sessions on one host never
share one, and a crashed session's locks vanish with its process.
Instance 0 is left to the host's own `hutch serve`.
"""

from __future__ import annotations

import fcntl
import os
import weakref
from pathlib import Path

LOCK_DIR = Path("/run/hutch-tests")
# Where each daemon locks its instance itself (`hutch serve` refuses to
# start on an instance another live daemon holds).
DAEMON_LOCK_DIR = Path("/run/hutch")
INSTANCES = range(1, 32)


def held_by_a_daemon(n: int) -> bool:
    """Whether a live daemon (not started through this module) holds `n`."""
    path = DAEMON_LOCK_DIR / f"net-{n}.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class NetInstance:
    """An instance held until `release` (or until the object is collected)."""

    def __init__(self, number: int, fd: int):
        self.number = number
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    @classmethod
    def claim(cls) -> "NetInstance":
        LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        for n in INSTANCES:
            fd = os.open(LOCK_DIR / f"net-{n}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if held_by_a_daemon(n):
                os.close(fd)
                continue
            return cls(n, fd)
        raise AssertionError(f"every network instance {INSTANCES.start}..{INSTANCES.stop - 1} is held by a test daemon")

    def release(self) -> None:
        self._finalizer()
