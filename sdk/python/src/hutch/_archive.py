"""Archives, streamed both ways, shared by the sync and the async client.

- `tar_chunks` packs a local directory as a tar, a chunk at a time (a file's
  content is read as it is sent, never held whole);
- `gzip_chunks` compresses such a stream (template build contexts);
- `form_chunks` frames a stream as the `archive` part of a form (archive
  uploads), without knowing its length;
- `TarExtractor` unpacks a tar pushed to it chunk by chunk into a staging
  directory beside the target, and moves it into place only once the archive
  was whole: a download cut short leaves nothing.

Extraction trusts nothing in the archive: names must be relative without
`..`; nothing is written through a symlink; symlinks are made only when
their target stays inside the target directory (others are listed in
`skipped`); hard links, devices and FIFOs are skipped; set-id bits dropped.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
import tempfile
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

from ._errors import HutchError, TransferIncompleteError

BLOCK = 512
READ_CHUNK = 1 << 20
#: Headers are gathered into chunks of about this size before they are sent.
FLUSH = 64 << 10

PathLike = Union[str, "os.PathLike[str]"]


class UnsafeArchiveError(HutchError):
    """An archive entry the SDK will not extract (code `unsafe_archive_entry`)."""


# --------------------------------------------------------------------------
# Packing


def _header(name: str, kind: bytes, size: int, mode: int, mtime: float) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    info.mode = mode & 0o777
    info.mtime = int(mtime)
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8", errors="strict")


def tar_entries(root: Path, follow_symlinks: bool) -> Iterator[Tuple[str, Path, os.stat_result]]:
    """(archive name, path, stat) of everything below `root`, parents first,
    in a stable order. Symlinks are followed or refused; sockets, FIFOs and
    devices are refused (the daemon accepts files and directories only)."""
    stack = [(root, "")]
    while stack:
        d, prefix = stack.pop()
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for e in entries:
            name = prefix + e.name
            p = Path(e.path)
            if e.is_symlink() and not follow_symlinks:
                raise ValueError(
                    f"{p} is a symlink; the daemon accepts files and directories only "
                    "(pass follow_symlinks=True to upload what it points to)"
                )
            st = p.stat() if follow_symlinks else p.lstat()
            if stat.S_ISDIR(st.st_mode):
                yield name + "/", p, st
                subdirs.append((p, name + "/"))
            elif stat.S_ISREG(st.st_mode):
                yield name, p, st
            else:
                raise ValueError(f"{p} is neither a file nor a directory; the daemon accepts only those")
        stack.extend(reversed(subdirs))


def tar_chunks(root: PathLike, follow_symlinks: bool = False) -> Iterator[bytes]:
    """A tar of the directory `root` (its contents, names relative to it)."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    pending = bytearray()
    for name, path, st in tar_entries(root, follow_symlinks):
        if name.endswith("/"):
            pending += _header(name, tarfile.DIRTYPE, 0, st.st_mode, st.st_mtime)
        else:
            size = st.st_size
            pending += _header(name, tarfile.REGTYPE, size, st.st_mode, st.st_mtime)
            sent = 0
            with open(path, "rb") as f:
                while sent < size:
                    if pending:
                        yield bytes(pending)
                        pending.clear()
                    chunk = f.read(min(READ_CHUNK, size - sent))
                    if not chunk:
                        raise OSError(f"{path} shrank while it was archived ({sent} of {size} bytes)")
                    sent += len(chunk)
                    yield chunk
            pending += b"\0" * ((BLOCK - size % BLOCK) % BLOCK)
        if len(pending) >= FLUSH:
            yield bytes(pending)
            pending.clear()
    pending += b"\0" * (2 * BLOCK)
    yield bytes(pending)


def gzip_chunks(chunks: Iterable[bytes], level: int = 6) -> Iterator[bytes]:
    z = zlib.compressobj(level, zlib.DEFLATED, 31)
    for c in chunks:
        out = z.compress(c)
        if out:
            yield out
    yield z.flush()


def new_boundary() -> str:
    return "hutch-" + uuid.uuid4().hex


def form_chunks(boundary: str, fields: Dict[str, str], file_field: str, filename: str,
                chunks: Iterable[bytes]) -> Iterator[bytes]:
    """A multipart form: the text fields first, then one file part streamed
    from `chunks` (its length need not be known)."""
    head = bytearray()
    for k, v in fields.items():
        head += f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n'.encode()
        head += v.encode() + b"\r\n"
    head += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; filename="{filename}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    yield bytes(head)
    yield from chunks
    yield f"\r\n--{boundary}--\r\n".encode()


# --------------------------------------------------------------------------
# Unpacking


def _number(field: bytes) -> int:
    if field and field[0] & 0x80:  # base-256 (GNU), for values past the octal field
        v = field[0] & 0x3F
        for b in field[1:]:
            v = (v << 8) | b
        return v
    text = field.split(b"\0", 1)[0].strip(b" \0")
    return int(text, 8) if text else 0


def _cstr(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> Dict[str, str]:
    out: Dict[str, str] = {}
    pos = 0
    while pos < len(data):
        sp = data.index(b" ", pos)
        length = int(data[pos:sp])
        record = data[sp + 1 : pos + length - 1]
        k, _, v = record.partition(b"=")
        out[k.decode()] = v.decode("utf-8", "surrogateescape")
        pos += length
    return out


@dataclass
class ExtractResult:
    """What a directory download wrote."""

    files: int = 0
    directories: int = 0
    symlinks: int = 0
    bytes: int = 0
    #: entries not written, with why (a symlink out of the tree, a device, ...)
    skipped: List[str] = field(default_factory=list)


def safe_name(name: str) -> str:
    """An archive name as a relative path inside the target, or raises."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or any(p == ".." for p in parts) or "\0" in name:
        raise UnsafeArchiveError(f"archive entry {name!r} points outside the target", code="unsafe_archive_entry")
    return "/".join(parts)


class TarExtractor:
    """Unpacks a tar fed to it in chunks of any size.

    Entries go to a staging directory created beside (or inside) `dest`;
    `finish` checks the archive ended properly and moves everything into
    `dest` (merging into existing directories, replacing files); `abort`
    removes the staging directory. Either must be called."""

    #: Largest GNU long name or pax header taken.
    META_CAP = 1 << 20

    def __init__(self, dest: PathLike):
        self.dest = Path(dest)
        if self.dest.exists() and not self.dest.is_dir():
            raise NotADirectoryError(f"{self.dest} exists and is not a directory")
        parent = self.dest if self.dest.is_dir() else self.dest.parent
        parent.mkdir(parents=True, exist_ok=True)
        self.stage = Path(tempfile.mkdtemp(prefix=".hutch-download-", dir=parent))
        self.result = ExtractResult()
        self._buf = bytearray()
        self._need = BLOCK  # bytes wanted for the current step
        self._step = "header"
        self._remaining = 0
        self._pad = 0
        self._file: Optional[int] = None
        self._meta = bytearray()
        self._meta_kind = b""
        self._long_name: Optional[str] = None
        self._long_link: Optional[str] = None
        self._pax: Dict[str, str] = {}
        self._zero_blocks = 0
        self._ended = False

    # ---- feeding

    def feed(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            if self._ended:
                return  # trailing blocks after the end marker
            if self._step == "data":
                take = min(len(view), self._remaining)
                self._data(view[:take])
                view = view[take:]
                self._remaining -= take
                if self._remaining == 0:
                    self._end_entry()
                continue
            if self._step == "pad":
                take = min(len(view), self._pad)
                view = view[take:]
                self._pad -= take
                if self._pad == 0:
                    self._step = "header"
                continue
            take = min(len(view), BLOCK - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == BLOCK:
                block = bytes(self._buf)
                self._buf.clear()
                self._header(block)

    def finish(self) -> ExtractResult:
        if not self._ended:
            self.abort()
            raise TransferIncompleteError(
                "the archive ended before its end (the daemon cuts a download short when it fails part way)",
                code="transfer_incomplete",
            )
        try:
            self._move_into_place()
        finally:
            shutil.rmtree(self.stage, ignore_errors=True)
        return self.result

    def abort(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None
        shutil.rmtree(self.stage, ignore_errors=True)

    # ---- steps

    def _header(self, block: bytes) -> None:
        if block == b"\0" * BLOCK:
            self._zero_blocks += 1
            if self._zero_blocks >= 2:
                self._ended = True
            return
        self._zero_blocks = 0
        want = _number(block[148:156])
        got = sum(block[:148]) + 8 * 32 + sum(block[156:])
        if want != got:
            raise UnsafeArchiveError("malformed tar header (bad checksum)", code="unsafe_archive_entry")
        kind = block[156:157]
        size = _number(block[124:136])
        if kind in (b"L", b"K", b"x", b"g"):
            if size > self.META_CAP:
                raise UnsafeArchiveError("tar metadata entry too large", code="unsafe_archive_entry")
            self._meta_kind = kind
            self._meta.clear()
            self._begin_data(size, meta=True)
            return
        name = _cstr(block[0:100])
        magic = block[257:263]
        if magic == b"ustar\x00":  # POSIX: a prefix may hold the leading part
            prefix = _cstr(block[345:500])
            if prefix:
                name = prefix + "/" + name
        link = _cstr(block[157:257])
        if self._long_name is not None:
            name, self._long_name = self._long_name, None
        if self._long_link is not None:
            link, self._long_link = self._long_link, None
        if self._pax:
            name = self._pax.get("path", name)
            link = self._pax.get("linkpath", link)
            if "size" in self._pax:
                size = int(self._pax["size"])
            self._pax = {}
        mode = _number(block[100:108]) & 0o777
        rel = safe_name(name)
        if kind in (b"0", b"\0", b"7"):
            if not rel:
                raise UnsafeArchiveError(f"archive file entry {name!r} has no name", code="unsafe_archive_entry")
            target = self._target(rel)
            self._file = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.fchmod(self._file, mode | 0o600)
            self.result.files += 1
            self._begin_data(size)
        elif kind == b"5":
            if rel:
                target = self._target(rel)
                if not target.is_dir() or target.is_symlink():
                    os.mkdir(target, 0o700)
                    self.result.directories += 1
                # The owner keeps rwx: later entries are written into it.
                os.chmod(target, mode | 0o700)
            self._begin_data(size)
        elif kind == b"2":
            self._symlink(rel, link)
            self._begin_data(size)
        else:
            self.result.skipped.append(f"{name} (type {kind.decode(errors='replace')!r})")
            self._begin_data(size)

    def _begin_data(self, size: int, meta: bool = False) -> None:
        self._remaining = size
        self._pad = (BLOCK - size % BLOCK) % BLOCK
        self._step = "data"
        if not meta:
            self._meta_kind = b""
        if size == 0:
            self._end_entry()

    def _data(self, data: memoryview) -> None:
        if self._meta_kind:
            self._meta += data
        elif self._file is not None:
            mv = data
            while mv:
                n = os.write(self._file, mv)
                mv = mv[n:]
            self.result.bytes += len(data)

    def _end_entry(self) -> None:
        if self._meta_kind:
            meta = bytes(self._meta)
            if self._meta_kind == b"L":
                self._long_name = meta.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif self._meta_kind == b"K":
                self._long_link = meta.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif self._meta_kind == b"x":
                self._pax = _pax(meta)
            self._meta_kind = b""
            self._meta.clear()
        if self._file is not None:
            os.close(self._file)
            self._file = None
        self._step = "pad" if self._pad else "header"

    def _target(self, rel: str) -> Path:
        """The staging path of `rel`, its parents made; never through a symlink."""
        parts = rel.split("/")
        d = self.stage
        for p in parts[:-1]:
            d = d / p
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                os.mkdir(d, 0o755)
                self.result.directories += 1
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafeArchiveError(f"archive entry {rel!r} passes through a non-directory",
                                         code="unsafe_archive_entry")
        target = d / parts[-1]
        if os.path.lexists(target) and not (target.is_dir() and not target.is_symlink()):
            os.unlink(target)
        return target

    def _symlink(self, rel: str, link: str) -> None:
        if not rel:
            return
        inside = not link.startswith("/") and not os.path.normpath(
            os.path.join(os.path.dirname(rel), link)).startswith("..")
        if not inside or not link:
            self.result.skipped.append(f"{rel} (symlink to {link!r}, outside the directory)")
            return
        os.symlink(link, self._target(rel))
        self.result.symlinks += 1

    def _move_into_place(self) -> None:
        if not self.dest.exists():
            os.rename(self.stage, self.dest)
            os.chmod(self.dest, 0o755)
            return
        _merge(self.stage, self.dest)


def _merge(src: Path, dst: Path) -> None:
    """Moves the contents of `src` into the directory `dst`: directories merge,
    anything else replaces what is there."""
    for entry in os.scandir(src):
        s = Path(entry.path)
        d = dst / entry.name
        if entry.is_dir(follow_symlinks=False) and d.is_dir() and not d.is_symlink():
            _merge(s, d)
            continue
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d)
        os.replace(s, d)
