"""``restore_backend``: a keyed backend back from checkpoint handles = snapshots + log replay.

Theory of operation (Flink's ``ChangelogBackendRestoreOperation``, plus what it lacks)
--------------------------------------------------------------------------------------
1. Parse and validate the handles (untrusted input; JSON strings are accepted).
2. Build an empty backend for the new key-group range (the range may differ from the old ones:
   several old handles on scale-in, part of one on scale-out; old handles that do not intersect
   the new range are not read at all).
3. Load the materialized snapshots: for each snapshot object, read its tail, its metadata block
   (the state registry at that time) and ONLY the key-group blocks in the new range — with ranged
   reads, or through the process's :class:`~restore.cache.LocalFileCache`.
4. Replay the non-materialized change sets in sqn order, per handle, WITHOUT logging them again;
   metadata records rebuild the state registry. State ids are mapped by state name per snapshot
   and per log, so backends that numbered their states differently can be merged.
5. Install the restored snapshot and log handles as the base of the new backend's next
   checkpoints (until its first materialization), as Flink does; its new writer continues.

Strict: a missing or corrupt object is a typed error that names the object, the offset and the
checkpoint. A restore that fails closes what it opened (no leaked threads or writers).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from dstl.errors import CorruptObjectError, DstlError, ObjectNotFoundError, UsageError
from dstl.handle import ChangelogHandle
from dstl.keygroups import KeyGroupRange
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.options import BackendOptions
from materializer.state_tables import BlobRangeSource, SnapshotReader
from restore.reader import ChangelogReader, verify_snapshot

__all__ = ["RestoreStats", "restore_backend"]

logger = logging.getLogger(__name__)


class RestoreStats(dict[str, float]):
    """Figures of one restore: snapshots/change sets read, entries loaded, changes replayed,
    seconds per phase."""


def _parse(handles: Iterable[ChangelogStateBackendHandle | str | bytes]
           ) -> list[ChangelogStateBackendHandle]:
    out = []
    for h in handles:
        out.append(h if isinstance(h, ChangelogStateBackendHandle)
                   else ChangelogStateBackendHandle.from_json(h))
    return out


def _with_checkpoint(exc: DstlError, checkpoint: str) -> DstlError:
    """The same error type, its message extended with the checkpoint being restored."""
    if isinstance(exc, CorruptObjectError):
        out: DstlError = type(exc).__new__(type(exc))
        CorruptObjectError.__init__(out, exc.key, exc.offset,  # type: ignore[arg-type]
                                    f"{exc.reason} (while restoring checkpoint {checkpoint})")
        out.__dict__.update({k: v for k, v in exc.__dict__.items() if k != "reason"})
        return out
    if isinstance(exc, ObjectNotFoundError):
        return ObjectNotFoundError(f"{exc} (while restoring checkpoint {checkpoint}; the object "
                                   "was deleted or never written — restore an earlier "
                                   "checkpoint)", key=exc.key)
    return exc


class _CacheRangeSource:
    """A snapshot's bytes through the restore cache (one download per cache)."""

    def __init__(self, cache: Any, store: Any, key: str) -> None:
        # the whole object is verified once (object CRC, every block) before it is cached
        self._lease = cache.lease(store, key, verify=verify_snapshot)
        self._key = key

    def size(self) -> int:
        return int(self._lease.size)

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._lease.read(offset, length))

    def close(self) -> None:
        self._lease.release()


def restore_backend(handles: Iterable[ChangelogStateBackendHandle | str | bytes], storage: Any,
                    key_groups: KeyGroupRange, table: str = "heap", cache: Any = None, *,
                    operator_id: str | None = None, max_parallelism: int | None = None,
                    options: BackendOptions | None = None, local_directory: str | None = None,
                    timer: Any = None, allow_pickle: bool = False,
                    stats: RestoreStats | None = None,
                    auto_materialize: bool = True) -> ChangelogKeyedStateBackend:
    """Restore a keyed backend for ``key_groups`` from checkpoint handles.

    Args:
        handles: the backends' handles of one checkpoint (objects or their JSON).
        storage: the process's :class:`~dstl.ChangelogStorage` (the new writer lives there).
        key_groups: the restored backend's range (rescaling: any range).
        table: ``"heap"`` or ``"lmdb"`` (independent of the table the checkpoint came from).
        cache: a :class:`~restore.cache.LocalFileCache` shared by the process's restores (or any
            :class:`~restore.reader.LeasingCache`, such as the Spark executor agent's
            ``AgentCache``), or ``None`` for direct ranged reads.
        operator_id: the new backend's id (default: the handles' id when they agree).
        max_parallelism: default: from the handles (they must agree).
        options, local_directory, timer, auto_materialize: passed to the backend.
        allow_pickle: allow states whose metadata names the pickle codec (executes code from the
            store on load; only for trusted checkpoints).
        stats: filled with figures of this restore.

    Raises:
        UsageError: malformed handles, or ids/parallelism that cannot be inferred.
        ObjectNotFoundError, CorruptObjectError: a needed object is missing or damaged (the
            message names the object, the offset and the checkpoint).
    """
    hs = _parse(handles)
    if operator_id is None:
        ids = {h.operator_id for h in hs}
        if len(ids) != 1:
            raise UsageError(f"cannot infer operator_id from handles of {sorted(ids)}; pass "
                             "operator_id=")
        operator_id = ids.pop()
    mps = {h.max_parallelism for h in hs}
    if max_parallelism is None:
        if len(mps) != 1:
            raise UsageError(f"handles disagree on max_parallelism ({sorted(mps)}); pass "
                             "max_parallelism=")
        max_parallelism = mps.pop()
    elif mps and mps != {max_parallelism}:
        raise UsageError(f"handles were written with max_parallelism {sorted(mps)}, not "
                         f"{max_parallelism}: key groups cannot be remapped")
    checkpoint = ",".join(sorted({str(h.checkpoint_id) for h in hs})) or "?"
    st = stats if stats is not None else RestoreStats()
    t0 = time.monotonic()
    backend = ChangelogKeyedStateBackend(storage, operator_id, key_groups, max_parallelism,
                                         table=table, options=options,
                                         local_directory=local_directory, timer=timer,
                                         clear_local=True, auto_materialize=auto_materialize)
    try:
        mats: list[SnapshotRef] = []
        nons: list[ChangelogHandle] = []
        seen: set[str] = set()
        for h in hs:
            for ref in h.materialized:
                if ref.key not in seen and len(ref.key_groups.intersection(key_groups)):
                    seen.add(ref.key)
                    mats.append(ref)
            nons.extend(n for n in h.non_materialized
                        if len(n.key_groups.intersection(key_groups)))
        _load_snapshots(backend, mats, storage.store, cache, key_groups, allow_pickle, st)
        t1 = time.monotonic()
        _replay(backend, nons, storage, cache, key_groups, allow_pickle, st)
        t2 = time.monotonic()
        backend.install_restored(mats, nons, max((h.materialization_id for h in hs), default=0))
        st.update({"snapshot_seconds": t1 - t0, "replay_seconds": t2 - t1,
                   "total_seconds": t2 - t0})
        logger.info("restored backend %s (%s, key groups %s) from checkpoint %s: %d snapshot(s), "
                    "%d entries, %d change sets, %d changes in %.3fs", operator_id, table,
                    key_groups, checkpoint, len(mats), st.get("entries", 0),
                    st.get("change_sets", 0), st.get("changes", 0), t2 - t0)
        return backend
    except DstlError as exc:
        backend.close()
        raise _with_checkpoint(exc, checkpoint) from exc
    except BaseException:
        backend.close()
        raise


def _load_snapshots(backend: ChangelogKeyedStateBackend, refs: list[SnapshotRef], store: Any,
                    cache: Any, key_groups: KeyGroupRange, allow_pickle: bool,
                    st: RestoreStats) -> None:
    entries = 0
    for ref in refs:
        source: Any = _CacheRangeSource(cache, store, ref.key) if cache is not None \
            else BlobRangeSource(store, ref.key)
        try:
            reader = SnapshotReader(source, key=ref.key)
            try:
                meta = json.loads(reader.metadata)
                states = meta["states"]
                if not isinstance(states, dict):
                    raise TypeError("states is not an object")
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptObjectError(ref.key, 0, f"snapshot metadata is not DSTL's: "
                                                     f"{exc}") from exc
            remap = {int(sid): backend.register_restored_state(m, int(sid),
                                                               allow_pickle=allow_pickle)
                     for sid, m in states.items()}
            wanted = key_groups.intersection(reader.key_groups)
            for kg, block in reader.read(wanted):
                entries += backend.load_snapshot_entries(kg, block, remap)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
    st["snapshots"] = len(refs)
    st["entries"] = entries


def _replay(backend: ChangelogKeyedStateBackend, handles: list[ChangelogHandle], storage: Any,
            cache: Any, key_groups: KeyGroupRange, allow_pickle: bool, st: RestoreStats) -> None:
    reader = ChangelogReader(storage, cache=cache)
    changes = 0
    sets = 0
    with backend.tables.write_batch():
        for h in handles:
            remap: dict[int, int] = {}  # each handle's log is self-describing
            for kg, payload in reader.read(h, key_groups=key_groups):
                backend.apply_change(kg, payload, remap=remap, allow_pickle=allow_pickle)
                changes += 1
            sets += len(h)
    st["change_sets"] = sets
    st["changes"] = changes
