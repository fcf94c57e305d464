"""Opening the files of a folder that someone else may write into: regular files only, never blocking.

What this is: `open_regular` and the two readers built on it, used by rapo_fast/_atomic.py.
What this is not: the save protocol (rapo_fast/_atomic.py), or a defence against a folder whose own path is a symlink
(only the last component of a path is checked).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat

__all__ = ["NotRegularFileError", "open_regular", "read_regular", "sha256_file"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class NotRegularFileError(OSError):
    """A named pipe, device, directory or refused symlink where a regular file was expected (errno EINVAL, the path)."""


def open_regular(path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o644, *, follow: bool = True) -> int:
    """os.open of a regular file only, never blocking: O_NONBLOCK (a named pipe opened for reading waits for a writer)
    then fstat; anything but a regular file (and, with follow=False, a symlink) raises NotRegularFileError naming the
    path. Returns a blocking fd. Other failures (FileNotFoundError, PermissionError) propagate as they are."""
    flags |= _NONBLOCK | _CLOEXEC | (0 if follow else _NOFOLLOW)
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        # ELOOP: a symlink under O_NOFOLLOW (EMLINK on FreeBSD); ENXIO: a named pipe opened for writing without a
        # reader; EISDIR: a directory opened for writing
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EMLINK):
            raise NotRegularFileError(errno.EINVAL, _NOT_REGULAR, str(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(errno.EINVAL, _NOT_REGULAR, str(path))
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


_NOT_REGULAR = "not a regular file (a named pipe, device, directory or symlink is refused)"


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 of a regular file (open_regular: a named pipe or device raises NotRegularFileError, never blocks)."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_regular(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of a regular file (at most limit + 1 when limit is given), through open_regular."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read() if limit is None else f.read(limit + 1)
