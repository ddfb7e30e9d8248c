"""The completion pipe: a finished push and pull tells a polling thread so by writing its 8-byte tag.

A non-blocking pipe that a thread polls beside its sockets (the local reduction's service thread): the
party that finishes a request writes the request's tag, 8 bytes in native byte order, as the C++ engine's
``PushPullOp.notify`` does. Torch-free, so that servers and the scheduler, which import the PS client,
start without torch.
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["open_tag_pipe", "read_tags", "write_tag"]

TAG_BYTES = 8


def open_tag_pipe() -> tuple[int, int]:
    """A new non-blocking, close-on-exec pipe: ``(read_fd, write_fd)``."""
    return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)


def write_tag(fd: int, tag: int) -> None:
    """Write one tag (a full pipe or a closed reader loses it)."""
    with contextlib.suppress(OSError):
        os.write(fd, tag.to_bytes(TAG_BYTES, sys.byteorder))


def read_tags(fd: int, most: int) -> list[int]:
    """The tags waiting in the pipe, up to ``most`` (none when it is empty)."""
    try:
        data = os.read(fd, TAG_BYTES * max(1, most))
    except BlockingIOError:
        return []
    return [int.from_bytes(data[i : i + TAG_BYTES], sys.byteorder) for i in range(0, len(data), TAG_BYTES)]
