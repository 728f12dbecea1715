"""Giving a process's freed heap memory back to the operating system.

Theory of operation
-------------------
glibc's ``malloc`` serves blocks below its mmap threshold from the process heap, and ``free``
returns them to the heap, not to the system: the heap shrinks only from its top. LMDB's write
transactions (4 KiB page buffers, one per page a transaction changed, freed when the
environment closes), a batch's change records and a segment's bytes are such blocks; after a
large batch most of them are free but interleaved with a few live ones, so the process keeps
the batch's peak as its resident size for the rest of its life (measured: a worker that wrote
250 k entries of 256-byte values in one batch kept 529 MB anonymous memory after the batch; after
:func:`release_free_memory`, 312 MB). ``malloc_trim(0)`` hands every free page inside the heap
back (``MADV_DONTNEED``); the blocks stay valid, so it is safe at any time, from any thread.

Called where a large transient allocation has just ended: after an LMDB table releases a large
transaction's pages (:mod:`materializer.lmdb_table`) and in the executor agent's materializer
loop (:mod:`dstl.spark.agent.materializer`), which outlives every batch. Elsewhere than glibc
(musl, macOS) there is nothing to call and the function returns ``False``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any

__all__ = ["release_free_memory"]

_lock = threading.Lock()
_trim: Any = None
_looked_up = False


def _malloc_trim() -> Any:
    global _trim, _looked_up
    with _lock:
        if not _looked_up:
            _looked_up = True
            fn: Any = None
            try:
                fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc: no malloc_trim to call
                fn = None
            if fn is not None:
                fn.argtypes = [ctypes.c_size_t]
                fn.restype = ctypes.c_int
            _trim = fn
        return _trim


def release_free_memory() -> bool:
    """Return the free pages of the process heap to the system (glibc's ``malloc_trim(0)``).

    Returns:
        Whether anything was released (``False`` also where the C library has no
        ``malloc_trim``).
    """
    fn = _malloc_trim()
    if fn is None:
        return False
    return bool(fn(0))
