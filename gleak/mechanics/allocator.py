"""Keep freed tensor memory in the process heap (glibc), for loops that allocate the same large tensors each step.

glibc serves every allocation above its mmap threshold (at most 32 MiB by default) with a fresh mmap and returns it
to the system on free, so a loop that allocates a 100 MB temporary per iteration pays the kernel to zero its pages
again every time: measured on CGD's vectorised engine (benchmarks/cgd_speed.py), a third of an iteration's CPU
time was system time. Raising the mmap and trim thresholds keeps those blocks in the heap for reuse. Numerics are
untouched (only where memory comes from). A no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap
TRIM_THRESHOLD = 2**31 - 1  # free memory at the heap's top is kept, up to the largest value mallopt takes (an int)


@functools.lru_cache(maxsize=1)
def retain_freed_memory() -> bool:
    """Set the thresholds once per process; True where glibc accepted them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    return mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
