"""Atomic file writes: a reader (or a restart after a crash) sees the old file or the new one, never half.

The data goes to a temporary file in the target's directory (the same file system, so the rename is
atomic), is flushed to disk with ``fsync``, and replaces the target with ``os.replace``; the directory is
then synced too, so that the rename itself survives a power loss. Each writer has its own temporary file,
so concurrent writers of one path do not mix their bytes: the last rename wins.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_open", "write_bytes_atomic", "write_text_atomic"]


@contextlib.contextmanager
def atomic_open(path: str | Path) -> Iterator[BinaryIO]:
    """Open a binary file that replaces ``path`` when the ``with`` block ends without an exception.

    Creates the missing parent directories. On an exception the temporary file is removed and ``path`` is
    left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see the module docstring)."""
    with atomic_open(path) as fh:
        fh.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically (see the module docstring)."""
    write_bytes_atomic(path, text.encode())
