"""A restoring process for tests/integration/restore/test_restore_prefetch.py, SIGKILLed mid-prefetch.

    python prefetch_child.py STORE_DIR HANDLE_FILE CACHE_DIR LATENCY_S

Opens a ``LocalFileCache`` in CACHE_DIR and restores the backend handle in HANDLE_FILE from the
local directory STORE_DIR, read through a ``FaultyFileSystem(latency_s=LATENCY_S)`` that serves
the first object read and stalls every read of another (so one file gets cached while the other
downloads stay in flight, however loaded the machine: a wait for that moment between two cache
events could miss it), in a thread; once the cache holds a published file while downloads are
in flight it prints ``prefetching`` and waits to be killed.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import fsspec

from dstl import ChangelogStorage
from materializer.handles import ChangelogStateBackendHandle
from materializer.options import BackendOptions
from restore import LocalFileCache, restore_backend
from support.faulty_fs import FaultyFileSystem


class _FirstThenStall(FaultyFileSystem):  # type: ignore[misc]
    """Reads of the first path read go through; reads of any other path stall (until the
    process is killed)."""

    def __init__(self, inner: fsspec.AbstractFileSystem, latency_s: float) -> None:
        super().__init__(inner, latency_s=latency_s)
        self._first: str | None = None
        self._first_lock = threading.Lock()

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: object) -> bytes:
        with self._first_lock:
            if self._first is None:
                self._first = path
            stall = path != self._first
        if stall:
            time.sleep(_STALL_S)
        data: bytes = super().cat_file(path, start=start, end=end, **kwargs)
        return data


#: Longer than the test waits for this process (it is SIGKILLed as soon as it prints).
_STALL_S = 600.0


def main(argv: list[str]) -> int:
    store_dir, handle_file, cache_dir, latency = argv
    handle = ChangelogStateBackendHandle.from_json(Path(handle_file).read_text())
    ffs = _FirstThenStall(fsspec.filesystem("file"), float(latency))
    storage = ChangelogStorage(store_dir, filesystem=ffs)
    cache = LocalFileCache(cache_dir)
    opts = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
    threading.Thread(target=restore_backend, name="child-restore", daemon=True,
                     args=([handle], storage, handle.key_groups),
                     kwargs={"cache": cache, "options": opts}).start()
    cache.wait_for_stats(lambda s: s["files"] >= 1 and s["downloads_in_flight"] >= 1, 60.0)
    print("prefetching", flush=True)
    time.sleep(120)  # the test SIGKILLs this process here
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
