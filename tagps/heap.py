"""The C heap of a tagps process: keep freed buffers for reuse instead of faulting fresh pages in."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["glibc_env", "keep_freed_buffers"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest allowed value on 64-bit
_RETAIN_BYTES = 1 << 30


@functools.cache
def keep_freed_buffers(retain_bytes: int = _RETAIN_BYTES) -> bool:
    """Make glibc's malloc reuse freed buffers instead of returning them to the kernel.

    A training step allocates and frees buffers of a tensor's size every time: ZeroMQ a fresh one for
    every received message, torch the temporaries of an optimizer step (Adam's ``sqrt`` and division of
    each parameter). With glibc's defaults a freed multi-MiB buffer is unmapped (or trimmed) and the next
    one is faulted in again page by page. Measured: a 64 MiB push_pull cost each worker ~1,400 and the
    server ~6,800 page faults per round, with the heap kept about 1; vgg-mini's Adam step on one CPU
    thread 7,600 per step, kept 100. Whether a process faults so depends on its allocation history: two
    ranks of tagps all-reduce on one emulated machine took 150,000 faults in 4 s in one run and 357-1,274
    in others. Process-wide, so once per process is enough (later calls return the first's answer):
    buffers below 32 MiB come from the heap, and up to ``retain_bytes`` of free heap is kept. Returns
    False (and changes nothing) where the C library has no ``mallopt``.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.debug("no mallopt in the C library; buffers are allocated with its defaults")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    retain = min(retain_bytes, (1 << 31) - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, retain))


def glibc_env(retain_bytes: int = _RETAIN_BYTES) -> dict[str, str]:
    """The environment that gives a process which never calls :func:`keep_freed_buffers` the same heap.

    glibc's malloc reads these tunables at start-up. Benchmarks give them to the baselines that do not run
    tagps (Horovod under ``horovodrun``), so that tagps's heap setting is not counted as its speed-up.
    """
    return {
        "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD_MAX),
        "MALLOC_TRIM_THRESHOLD_": str(min(retain_bytes, (1 << 31) - 1)),
    }
