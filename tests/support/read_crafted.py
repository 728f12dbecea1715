"""Read one crafted object the way DSTL meets it, in this fresh process; print the outcome and the
process's peak RSS (``VmHWM``) as one JSON line.

Usage: ``python read_crafted.py <directory>`` where the directory holds ``spec.json``
(``{"read": ..., "key": ..., "name": ...}``), ``object`` (the object's bytes) and, for restores
and handles, ``handle.json``. ``read``:

- ``restore``: a heap ``restore_backend`` from the handle, the object stored under ``key`` in a
  :class:`~dstl.stores.LocalBlobStore` (direct ranged reads; then again through a
  ``LocalFileCache``, which verifies the whole object);
- ``handle``: ``ChangelogStateBackendHandle.from_json``;
- ``manifest``: ``decode_manifest``; ``marker``: ``TableMarker.from_bytes``; ``frame``: the
  agent's ``FrameDecoder`` and ``decode_request``.

The outcome is ``ok`` (read without error), or the error's type and message; an error that is
not a ``DstlError`` is reported as such (the test fails on it). The address space is capped
(``RLIMIT_AS``, 4 GiB) so that a decoder that would allocate gigabytes fails here instead of
swapping the machine; such a failure is a ``MemoryError``, which is not a ``DstlError``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from pathlib import Path

resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _peak_kib() -> int:
    """This process's peak RSS (VmHWM: ``ru_maxrss`` would include the parent's, as Linux
    keeps it across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _restore(spec: dict[str, str], data: bytes, handle: str, workdir: str) -> None:
    from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
    from dstl.stores import LocalBlobStore
    from materializer.options import BackendOptions
    from restore.cache import LocalFileCache
    from restore.restore import restore_backend

    store = LocalBlobStore(os.path.join(workdir, "store"))
    store.put(spec["key"], data)
    options = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
    with ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0)) as storage:
        for n, cache_dir in enumerate((None, os.path.join(workdir, "cache"))):
            cache = LocalFileCache(cache_dir) if cache_dir else None
            try:
                backend = restore_backend([handle], storage, KeyGroupRange(0, 15),
                                          operator_id=f"crafted/{n}", options=options,
                                          cache=cache, auto_materialize=False)
                backend.close()
            finally:
                if cache is not None:
                    cache.close()


def _read(spec: dict[str, str], data: bytes, handle: str, workdir: str) -> None:
    kind = spec["read"]
    if kind == "restore":
        _restore(spec, data, handle, workdir)
    elif kind == "handle":
        from materializer.handles import ChangelogStateBackendHandle

        ChangelogStateBackendHandle.from_json(data)
    elif kind == "manifest":
        from dstl.checkpoint.manifest import decode_manifest

        decode_manifest(data, "checkpoints/0000000000000001-0001.manifest")
    elif kind == "marker":
        from materializer.table_marker import TableMarker

        TableMarker.from_bytes(data, where="crafted (table marker)")
    elif kind == "frame":
        from dstl.spark.agent.protocol import FrameDecoder, decode_request

        for header, body in FrameDecoder().feed(data):
            decode_request(header, body)
    else:
        raise SystemExit(f"unknown read {kind!r}")


def main() -> None:
    directory = Path(sys.argv[1])
    spec = json.loads((directory / "spec.json").read_text())
    data = (directory / "object").read_bytes()
    handle_path = directory / "handle.json"
    handle = handle_path.read_text() if handle_path.exists() else ""
    from dstl.errors import DstlError

    start_kib = _peak_kib()
    outcome: dict[str, object] = {"name": spec["name"], "outcome": "ok"}
    try:
        with tempfile.TemporaryDirectory(dir=directory) as workdir:
            _read(spec, data, handle, workdir)
    except DstlError as exc:
        outcome.update(outcome="typed", error=type(exc).__name__, message=str(exc)[:300])
    except BaseException as exc:  # reported to the test, which fails on it
        outcome.update(outcome="untyped", error=type(exc).__name__, message=str(exc)[:300])
    del data
    outcome.update(start_kib=start_kib, peak_kib=_peak_kib())
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
