"""What a CPU run asks of the C library's allocator: keep freed memory for reuse.

glibc maps every block of more than 32 MB afresh and unmaps it when it is freed, so each large
temporary of a step is faulted in and zeroed again: in ptb_gpt's emulated MXFP8 step, whose
output layer's gradient is 82 MB, about a third of the step's time went to the kernel
(results/cpu-alloc/). A CPU run therefore sets glibc's M_MMAP_MAX
to 0 (every block from the heap) and its M_TRIM_THRESHOLD to its largest (freed memory is not
returned), as MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 would. MPT_KEEP_FREED_MEMORY=0
leaves the allocator as it is; off glibc nothing is changed. Values are untouched: only where
memory comes from changes.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_MAX = -4
_kept = False


def keep_freed() -> bool:
    """Asks glibc to keep freed memory (see above); returns whether it now does."""
    global _kept
    if os.environ.get("MPT_KEEP_FREED_MEMORY", "1") == "0":
        return _kept
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return _kept
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc's own symbol: others' mallopt options differ
        return _kept
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1):  # 1 on success
        _kept = True
    return _kept


def release() -> None:
    """Returns the freed memory kept so far to the OS (glibc's malloc_trim), so that a run's peak
    RSS does not start from what the runs before it in the process freed."""
    if _kept:
        ctypes.CDLL(None).malloc_trim(0)


def kept() -> bool:
    """Whether this process asked glibc to keep freed memory, for the record."""
    return _kept
