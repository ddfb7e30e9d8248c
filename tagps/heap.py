"""The C heap of a tagps process: keep freed buffers for reuse instead of faulting fresh pages in."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

__all__ = ["glibc_env", "keep_freed_buffers"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_RETAIN_BYTES = 1 << 30
_C_INT_MAX = (1 << 31) - 1  # mallopt's value is a C int


def _settings(retain_bytes: int) -> list[tuple[int, str, int]]:
    """The heap settings as (mallopt parameter, the glibc environment variable for it, value)."""
    return [
        (_M_MMAP_MAX, "MALLOC_MMAP_MAX_", 0),
        (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", min(retain_bytes, _C_INT_MAX)),
    ]


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
    every buffer comes from the heap (no ``mmap`` of its own, which glibc would unmap on free, whatever its
    size), and up to ``retain_bytes`` of free heap is kept. Above 32 MiB, the largest mmap threshold glibc
    allows, only that keeps a buffer: VGG19's 64 MiB weight gradient, allocated afresh by every backward,
    cost 16,000 faults a step. Pages given back are dear on a VM with free page reporting (this host's
    virtio balloon): a 2-rank VGG19 job whose workers also trained a second replica spent up to 1.2 s of
    system time a step zeroing fresh pages (perf: ``clear_page_erms`` under sgemm); its ps steps took a
    median 0.98 s with buffers below 32 MiB kept, 0.71-0.81 s with all kept. Returns False (and changes
    nothing) where the C library has no ``mallopt``.
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
    return all(mallopt(param, value) for param, _, value in _settings(retain_bytes))


def glibc_env(retain_bytes: int = _RETAIN_BYTES) -> dict[str, str]:
    """The environment that gives a process which never calls :func:`keep_freed_buffers` the same heap.

    glibc's malloc reads these tunables at start-up. Benchmarks give them to the baselines that do not run
    tagps (Horovod under ``horovodrun``), so that tagps's heap setting is not counted as its speed-up.
    """
    return {name: str(value) for _, name, value in _settings(retain_bytes)}
