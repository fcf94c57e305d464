"""Crash-safe saving shared by rapo_fast's save formats: versioned directories, SHA-256 manifests, one atomic switch.

What this is: `VersionWriter` and `read_version`. The layout and the guarantees: docs/formats.md, "Versioned
directories", "Guarantees on a crash" and "Guarantees against what else is in the folder".
What this is not: a format's own schema (each owner checks its fields, with rapo_fast._checks.check_field), nor a
database: two processes saving into one directory are serialised by LOCK, not merged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from rapo_fast._checks import brief
from rapo_fast._files import _CLOEXEC, _NOFOLLOW, NotRegularFileError, open_regular, read_regular, sha256_file

try:
    import fcntl
except ImportError:  # not POSIX: saves into one directory must not overlap (nothing serialises them)
    fcntl = None

CURRENT, PENDING, LOCK, MANIFEST = "CURRENT", "PENDING", "LOCK", "meta.json"
_SMALL = 4096  # CURRENT and PENDING hold a few short lines; a bigger file is not one of ours
_BUFFER = 1 << 20  # small writes are gathered into 1 MiB os.write calls
_MAX_WRITE = 1 << 30  # one os.write at most (Linux writes at most about 2 GiB per call anyway)
_SHA = re.compile(r"[0-9a-f]{64}")
# Every file a save creates: a new name only, never through a symlink planted at that name.
_WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC


class FormatError(ValueError):
    """A saved directory is missing, corrupt, or of another format or version (base of each format's error class)."""


class Version(NamedTuple):
    """The live version of a versioned directory, checked: its path, its manifest's `meta` and `files`."""

    path: Path
    meta: dict[str, Any]
    files: dict[str, dict[str, Any]]


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that the entries created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
    """A new binary file written through os.write (1 MiB at a time), its SHA-256 and size computed as written.

    Usable as the file object of torch.save. close() fsyncs; the file is created exclusively (_WFLAGS). A failed
    os.write (ENOSPC) is raised as an OSError naming the file and kept in `error`: torch.save turns it into an obscure
    RuntimeError ("unexpected pos") for large tensors, and `raise_write_error` gives the caller the original back.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd = os.open(self.path, _WFLAGS, 0o644)
        self._sha = hashlib.sha256()
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self.size = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self._sha.update(view)
        self.size += n
        if self._pending_bytes + n < _BUFFER:  # small pieces (torch.save writes many): gathered, copied
            self._pending.append(bytes(view))
            self._pending_bytes += n
        else:  # a large piece goes straight from the caller's memory
            self._drain()
            self._write_all(view)
        return n

    def _write_all(self, view: memoryview) -> None:
        try:
            while len(view):
                view = view[os.write(self._fd, view[:_MAX_WRITE]) :]
        except OSError as exc:
            if self.error is None:
                self.error = OSError(exc.errno, f"{exc.strerror or exc} (writing)", str(self.path))
            raise self.error from exc

    def raise_write_error(self, exc: BaseException) -> None:
        """Raise the failed write's OSError in place of `exc` (what torch.save made of it); nothing if none failed."""
        if self.error is not None and exc is not self.error:
            raise self.error from exc

    def _drain(self) -> None:
        if self._pending:
            data = memoryview(b"".join(self._pending))
            self._pending, self._pending_bytes = [], 0
            self._write_all(data)

    def flush(self) -> None:
        self._drain()

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self._drain()
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1


def write_file_atomic(path: str | os.PathLike, write: Callable[[HashingWriter], None]) -> None:
    """Replace the file `path` atomically with what write(f) writes into a HashingWriter f (torch.save(obj, f)): a
    temporary of a random name beside it (_WFLAGS), fsynced, os.replace'd; on a failure (a failed write: its OSError)
    the temporary is removed and `path` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    w = HashingWriter(tmp)
    try:
        try:
            write(w)
        except BaseException as exc:
            w.raise_write_error(exc)
            raise
        finally:
            w.close()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # gone already (replaced), or unremovable: the original error matters
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def _write_small_atomic(root: Path, name: str, text: str) -> None:
    """Replace <root>/<name> with `text` atomically. A fixed temporary name (a killed write leaves one small file):
    whatever is there (a leftover, a planted symlink) is unlinked, never opened, then created exclusively (_WFLAGS)."""
    tmp = root / f".{name}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a symlink is removed itself, not its target; a directory there raises (IsADirectoryError)
    w = HashingWriter(tmp)  # its failed writes name the file
    try:
        try:
            w.write(text.encode("ascii"))
        finally:
            w.close()
    except OSError:  # e.g. a full disk: no temporary left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, root / name)
    fsync_dir(root)


def _read_small(path: Path) -> bytes | None:
    """At most _SMALL + 1 bytes of a regular file (open_regular); None when it does not exist."""
    try:
        return read_regular(path, _SMALL)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _names(prefix: str) -> re.Pattern:
    return re.compile(rf"{re.escape(prefix)}-[0-9a-f]{{32}}")


def _parse_current(root: Path, prefix: str, error: type[FormatError], what: str) -> tuple[str, str]:
    try:
        raw = _read_small(root / CURRENT)
    except NotRegularFileError as exc:
        raise error(f"{root / CURRENT}: expected a readable file, got {exc.strerror} (corrupt)") from None
    if raw is None:
        raise error(f"{root}: expected a saved {what}, got a folder without {CURRENT}")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise error(f"{root / CURRENT}: expected ASCII text, got other bytes (corrupt)") from None
    m = re.fullmatch(rf"({_names(prefix).pattern}) ([0-9a-f]{{64}})\n", text)
    if m is None:
        raise error(f"{root / CURRENT}: expected one line '<{prefix}-id> <sha256>', got {text[:100]!r} (corrupt)")
    return m.group(1), m.group(2)


@contextlib.contextmanager
def _locked(root: Path, exclusive: bool, error: type[FormatError] | None = None) -> Iterator[None]:
    """flock <root>/LOCK (exclusive: created if absent); not a regular file: `error` (a load) or NotRegularFileError."""
    if fcntl is None:
        yield
        return
    # a named pipe would block the open forever, a symlink would lock (or create) a file outside the folder
    try:
        fd = open_regular(root / LOCK, (os.O_RDWR | os.O_CREAT) if exclusive else os.O_RDONLY, follow=False)
    except NotRegularFileError as exc:
        if error is None:
            raise
        raise error(f"{root / LOCK}: expected a regular file, got {exc.strerror}") from None
    except OSError:
        if exclusive:
            raise
        yield  # a read-only copy without LOCK: nothing can save into it meanwhile
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock (the kernel also does on a kill)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# A file name of a version: the names the savers use (letters, digits, '.', '_', '-'; at most 8 levels, 100 characters
# a level). A manifest naming anything else (a 300-byte name, a NUL, a lone surrogate) is refused as corrupt before any
# file-system call could raise its own error (ENAMETOOLONG, ValueError) on it.
_REL_PART = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def _rel_ok(rel: Any) -> bool:
    if not isinstance(rel, str) or len(rel) > 1000:
        return False
    parts = rel.split("/")
    return len(parts) <= 8 and all(_REL_PART.fullmatch(p) and p not in (".", "..") for p in parts)


class VersionWriter:
    """One save into the versioned directory `root` (docs/formats.md, "Versioned directories").

    with VersionWriter(root, prefix, fmt, version) as w:
        w.write_bytes("a.json", ...); with w.open("b.pt") as f: torch.save(obj, f)
        other.save(w.path / "sub"); w.add_nested("sub")
        w.commit(meta)          # the new version becomes current here; nothing is current from it before
    """

    def __init__(self, root: str | os.PathLike, prefix: str, fmt: str, version: int):
        self.root, self.prefix, self.fmt, self.version = Path(root), prefix, fmt, version
        self.name = f"{prefix}-{uuid.uuid4().hex}"
        self.path = self.root / self.name
        self.files: dict[str, dict[str, Any]] = {}
        self._dirs: list[Path] = []
        self._pending: list[str] = []
        self._old: str | None = None
        self._lock: contextlib.AbstractContextManager | None = None
        self._committed = False

    def __enter__(self) -> VersionWriter:
        os.makedirs(self.root, exist_ok=True)
        self._lock = _locked(self.root, exclusive=True)
        self._lock.__enter__()
        try:
            self._prepare()
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self

    def _prepare(self) -> None:
        pattern = _names(self.prefix)
        try:
            old = _parse_current(self.root, self.prefix, FormatError, "")[0]
        except FormatError:
            old = None
        raw = _read_small(self.root / PENDING) or b""
        stale = [n for n in raw.decode("ascii", "replace").split() if pattern.fullmatch(n) and n != old]
        if old is not None:  # with a live version, what an earlier killed save listed is garbage: free it first
            for n in stale:
                _remove(self.root / n)
            stale = []
        # else: no live version; keep the earlier names listed, and remove them once this save is current
        self._old, self._pending = old, [self.name] + ([old] if old else []) + stale
        _write_small_atomic(self.root, PENDING, "".join(n + "\n" for n in self._pending))
        os.mkdir(self.path)

    def _new_path(self, rel: str) -> Path:
        if not _rel_ok(rel) or rel == MANIFEST:
            raise ValueError(
                f"VersionWriter: rel: expected a path of <= 8 plain parts (not {MANIFEST}), got {brief(rel)}"
            )
        path = self.path / rel
        for parent in reversed(PurePosixPath(rel).parents[:-1]):
            d = self.path / parent
            if not d.is_dir():
                os.mkdir(d)
                self._dirs.append(d)
        return path

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[HashingWriter]:
        """A new file of this version (relative POSIX path), recorded in the manifest once closed."""
        w = HashingWriter(self._new_path(rel))
        try:
            yield w
        except BaseException as exc:
            w.raise_write_error(exc)  # torch.save's RuntimeError for a full disk -> the OSError naming the file
            raise
        finally:
            w.close()
        self.files[rel] = {"sha256": w.sha256, "size": w.size}

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open(rel) as f:
            f.write(data)

    def add_nested(self, rel_dir: str) -> None:
        """Record the versioned directory saved into `self.path / rel_dir`: its CURRENT (which names its manifest's
        SHA-256, which names every file's) is listed, so the whole nested unit is covered."""
        rel = f"{rel_dir}/{CURRENT}"
        if not _rel_ok(rel):
            raise ValueError(f"VersionWriter: rel_dir: expected a path of <= 8 plain parts, got {brief(rel_dir)}")
        data = read_regular(self.path / rel)
        self.files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    def commit(self, meta: dict[str, Any]) -> Path:
        """Write the manifest, make this version current, then remove the version it replaces. Returns its path."""
        manifest = {"format": self.fmt, "format_version": self.version, "files": self.files, "meta": meta}
        with self._open_manifest() as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode())
        for d in [*self._dirs, self.path]:
            fsync_dir(d)
        _write_small_atomic(self.root, CURRENT, f"{self.name} {f.sha256}\n")
        self._committed = True
        for n in self._pending[1:]:
            _remove(self.root / n)
        left = [n for n in self._pending[1:] if os.path.lexists(self.root / n)]  # a removal that failed: next time
        if left:
            _write_small_atomic(self.root, PENDING, "".join(n + "\n" for n in left))
        else:
            os.unlink(self.root / PENDING)
            fsync_dir(self.root)
        return self.path

    @contextlib.contextmanager
    def _open_manifest(self) -> Iterator[HashingWriter]:
        w = HashingWriter(self.path / MANIFEST)
        try:
            yield w
        finally:
            w.close()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            # An exception (Ctrl-C, a SystemExit from a signal handler, EIO from the directory fsync) may arrive after
            # os.replace made this version current but before commit() returned: what CURRENT says decides, never
            # the flag. Only a version CURRENT provably does not name is undone; anything in doubt stays, listed in
            # PENDING, for the next save to sort out.
            if exc_type is not None and not self._committed and self._current_is_other():
                shutil.rmtree(self.path, ignore_errors=True)
                left = [n for n in self._pending[1:] if n != self._old]  # earlier leftovers still to remove
                if not self.path.exists():
                    with contextlib.suppress(OSError):
                        if left:
                            _write_small_atomic(self.root, PENDING, "".join(n + "\n" for n in left))
                        else:
                            os.unlink(self.root / PENDING)
        finally:
            self._lock.__exit__(None, None, None)

    def _current_is_other(self) -> bool:
        """CURRENT was read and names another version than this save's (or none); False when it cannot be read."""
        try:
            raw = _read_small(self.root / CURRENT)
        except OSError:
            return False
        return raw is None or not raw.startswith(f"{self.name} ".encode())


def read_json_object(path: Path, error: type[FormatError]) -> dict[str, Any]:
    """A saved file holding one JSON object; anything else raises `error` naming the file."""
    try:
        m = json.loads(read_regular(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: expected JSON, got {exc} (corrupt)") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise error(f"{path}: expected JSON, got JSON nested too deeply (corrupt)") from None
    except NotRegularFileError as exc:
        raise error(f"{path}: expected a readable file, got {exc.strerror} (corrupt)") from None
    if not isinstance(m, dict):
        raise error(f"{path}: expected a JSON object, got {type(m).__name__}")
    return m


def _parse_manifest(path: Path, fmt: str, version: int, error: type[FormatError]) -> dict[str, Any]:
    m = read_json_object(path, error)
    if m.get("format") != fmt:
        raise error(f"{path}: field 'format': expected {fmt!r}, got {brief(m.get('format'))}")
    v = m.get("format_version")
    if v != version or isinstance(v, bool):
        raise error(f"{path}: field 'format_version': expected {version} (this rapo_fast's), got {brief(v)}")
    files, meta = m.get("files"), m.get("meta")
    if not isinstance(files, dict) or not isinstance(meta, dict):
        raise error(
            f"{path}: 'files', 'meta': expected JSON objects, got {type(files).__name__}, {type(meta).__name__}"
        )
    for rel, entry in files.items():
        ok = isinstance(entry, dict) and set(entry) == {"sha256", "size"} and _rel_ok(rel)
        ok = ok and isinstance(entry["sha256"], str) and _SHA.fullmatch(entry["sha256"]) is not None
        ok = ok and isinstance(entry["size"], int) and not isinstance(entry["size"], bool) and entry["size"] >= 0
        if not ok:
            raise error(f"{path}: field 'files': expected {{sha256, size}} entries, got {brief(rel)}: {brief(entry)}")
    return m


@contextlib.contextmanager
def read_version(
    root: str | os.PathLike, prefix: str, fmt: str, version: int, error: type[FormatError]
) -> Iterator[Version]:
    """The live version of `root`, every file checked (size and SHA-256) against the manifest, whose own SHA-256 is
    in CURRENT. Holds a shared lock while the caller reads (a concurrent save cannot remove the version meanwhile)."""
    root, what = Path(root), fmt.rsplit(".", 1)[-1]
    try:
        is_dir = root.is_dir()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
        raise error(f"{root}: expected a saved {what}, got {exc}") from None
    if not is_dir:
        raise error(f"{root}: expected a saved {what}, got no such directory")

    def digest_of(p: Path) -> str:
        try:
            return sha256_file(p)
        except NotRegularFileError as exc:  # replaced by a named pipe since the is_file check: refused, not read
            raise error(f"{p}: expected a readable file, got {exc.strerror} (corrupt)") from None

    with _locked(root, exclusive=False, error=error):
        name, digest = _parse_current(root, prefix, error, what)
        vdir = root / name
        mpath = vdir / MANIFEST
        if not mpath.is_file():
            raise error(f"{root}: {CURRENT}: expected a version with a {MANIFEST}, got {name!r} without (incomplete)")
        if digest_of(mpath) != digest:
            raise error(f"{mpath}: expected the SHA-256 in {root / CURRENT}, got another (corrupt)")
        m = _parse_manifest(mpath, fmt, version, error)
        for rel, entry in m["files"].items():
            p = vdir / rel
            try:
                st = os.stat(p)
            except OSError as exc:  # missing, or a path the file system refuses (a loop of links, EACCES)
                raise error(f"{p}: expected a readable file (listed in {mpath}), got {exc.strerror}") from None
            if not stat.S_ISREG(st.st_mode):
                raise error(f"{p}: expected a regular file (listed in {mpath}), got another kind")
            if st.st_size != entry["size"]:
                raise error(f"{p}: expected {entry['size']} bytes ({mpath}'s), got {st.st_size} (corrupt)")
            if digest_of(p) != entry["sha256"]:
                raise error(f"{p}: expected the SHA-256 in {mpath}, got another (corrupt)")
        yield Version(vdir, m["meta"], m["files"])
