"""``restore_backend``: a keyed backend back from checkpoint handles = snapshots + log replay.

Theory of operation (Flink's ``ChangelogBackendRestoreOperation``, plus what it lacks)
--------------------------------------------------------------------------------------
1. Parse and validate the handles (untrusted input; JSON strings are accepted).
2. Plan (:func:`restore.plan.plan_restore`, pure): for every key group of the new range, the
   history the handles tell of it — which snapshot, then which change sets in which order —
   each change set once per key group whatever handles are passed (after any sequence of
   rescales, the same handle twice, two checkpoints of one backend); handles that tell two
   different histories of a key group are refused.
3. With a cache, tell it every object the plan will lease, in the order it will (the snapshots,
   then the segments in replay order; each once, with the lease's verify function): the cache
   downloads them in the background (:meth:`~restore.leasing.LeasingCache.prefetch`), so the
   downloads overlap each other and the loading below, and each lease joins its object's
   download or finds its file. Only a hint: a failed or skipped prefetch is forgotten and the
   lease downloads the object as it would without one; the restore cancels what is left of it
   when it ends, successful or not. Build an empty backend for the new key-group range.
4. Load the planned snapshots: for each snapshot reference, read its tail, its metadata block
   (the state registry at that time) and ONLY the key-group blocks it is loaded for — with
   ranged reads, or through the process's :class:`~restore.cache.LocalFileCache`.
5. Replay the planned change sets in plan order, each for its key groups only, WITHOUT logging
   them again; metadata records rebuild the state registry. State ids are mapped by state name
   per snapshot and per log (log id and writer range), so backends that numbered their states
   differently can be merged. A change outside its log's key-group range, or outside the
   key groups the plan replays it for, is corruption (:class:`CorruptObjectError` naming the
   segment and the record's offset), never skipped.
6. Install the planned snapshot and log handles — the new backend's share of the old ones,
   nothing more — as the base of its next checkpoints (until its first materialization), as
   Flink does; its new writer continues.

Steps 1-2 are a pure planner, :func:`restore.plan.plan_restore` (handles + the new range ->
:class:`~restore.plan.RestorePlan`: which snapshot references and which changelog handles to
read, for which key groups, which operator id and parallelism); :func:`restore_backend` builds
the backend and executes the plan (steps 3-6, the I/O). Strict: a missing or corrupt object is a
typed error that names the object, the offset and the checkpoint. A restore that fails closes
what it opened (no leaked threads or writers).

Every error of a stored object names the object: decoders of its parts (a change payload, a
state value, a metadata record, an entry) name placeholders, and the replay and the snapshot
loader, which know the segment and record (or snapshot and block), re-raise their errors with
:func:`dstl.errors.located`. A builtin exception escaping a decoder on crafted input (a decoder
bug) is turned into :class:`~dstl.errors.CorruptObjectError` naming the object, its cause
chained, so a restore from an untrusted store raises only DSTL errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence

from dstl.checks import (
    check_bool,
    check_choice,
    check_instance,
    check_optional_path,
    check_protocol,
    check_str,
)
from dstl.errors import (
    DECODER_BUGS,
    ConfigTypeError,
    CorruptObjectError,
    DstlError,
    ObjectNotFoundError,
    placed,
)
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange
from dstl.storage import ChangelogStorage
from dstl.stores.base import BlobStore
from dstl.timer import Timer, check_timer
from materializer.backend import ChangelogKeyedStateBackend, check_layout, check_storage
from materializer.changes import decode_snapshot_states
from materializer.delta_format import DELTA_VERSION, DeltaMeta, DeltaReader
from materializer.file_snapshot import snapshot_version
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.options import BackendOptions
from materializer.replay import BlockReplayer
from materializer.state_tables import BlobRangeSource, RangeSource, SnapshotReader
from restore.file_restore import (
    StagedSnapshot,
    install_file_snapshots,
    is_file_snapshot,
    read_at,
    remove_stale_staging,
    stage_file_snapshot,
)
from restore.gcpause import collector_paused
from restore.leasing import LeasingCache, ObjectLease, PrefetchItem, PrefetchTicket
from restore.plan import RestorePlan, plan_restore
from restore.reader import ChangelogReader, segment_verifier, snapshot_verifier

__all__ = ["RestorePlan", "RestoreStats", "check_delta_piece", "plan_restore", "prefetch_items",
           "restore_backend"]

logger = logging.getLogger(__name__)


class RestoreStats(dict[str, float]):
    """Figures of one restore: snapshots/change sets read, entries loaded, changes replayed,
    seconds per phase."""


def _parse(handles: Iterable[ChangelogStateBackendHandle | str | bytes]
           ) -> list[ChangelogStateBackendHandle]:
    return [h if isinstance(h, ChangelogStateBackendHandle)
            else ChangelogStateBackendHandle.from_json(h) for h in handles]


# --------------------------------------------------------------------------- executing it


def restore_backend(handles: Iterable[ChangelogStateBackendHandle | str | bytes],
                    storage: ChangelogStorage, key_groups: KeyGroupRange, table: str = "heap",
                    cache: LeasingCache | None = None, *,
                    operator_id: str | None = None, max_parallelism: int | None = None,
                    options: BackendOptions | None = None, local_directory: str | None = None,
                    timer: Timer | None = None, allow_pickle: bool = False,
                    stats: RestoreStats | None = None,
                    auto_materialize: bool = True,
                    prefetch: bool = True) -> ChangelogKeyedStateBackend:
    """Restore a keyed backend for ``key_groups`` from checkpoint handles.

    Args:
        handles: the backends' handles of one checkpoint (objects or their JSON).
        storage: the process's :class:`~dstl.ChangelogStorage` (the new writer lives there).
        key_groups: the restored backend's range (rescaling: any range).
        table: ``"heap"`` or ``"lmdb"`` (independent of the table the checkpoint came from).
        cache: a :class:`~restore.cache.LocalFileCache` shared by the process's restores (or any
            :class:`~restore.leasing.LeasingCache`, such as the Spark executor agent's
            ``AgentCache``), or ``None`` for direct ranged reads.
        operator_id: the new backend's id (default: the handles' id when they agree).
        max_parallelism: default: from the handles (they must agree).
        options, local_directory, timer, auto_materialize: passed to the backend.
        allow_pickle: allow states whose metadata names the pickle codec (executes code from the
            store on load; only for trusted checkpoints).
        stats: filled with figures of this restore.
        prefetch: with a cache, start downloading every object the restore needs before
            loading the first (``False``: each is downloaded when it is reached, as the
            benchmark's control does). Without a cache it changes nothing.

    Raises:
        UsageError: malformed handles, or ids/parallelism that cannot be inferred.
        ObjectNotFoundError, CorruptObjectError: a needed object is missing or damaged (the
            message names the object, the offset and the checkpoint).
    """
    _check_arguments(handles, storage, key_groups, table, cache, operator_id, max_parallelism,
                     options, local_directory, timer, allow_pickle, stats, auto_materialize,
                     prefetch)
    plan = plan_restore(_parse(handles), key_groups, operator_id=operator_id,
                        max_parallelism=max_parallelism)
    st = stats if stats is not None else RestoreStats()
    # before the backend is built: an LMDB table's creation overlaps the first downloads too
    with _prefetching(plan, storage, cache if prefetch else None, options or BackendOptions(),
                      st):
        backend = ChangelogKeyedStateBackend(storage, plan.operator_id, key_groups,
                                             plan.max_parallelism, table=table, options=options,
                                             local_directory=local_directory, timer=timer,
                                             clear_local=True, auto_materialize=auto_materialize)
        try:
            with collector_paused(freeze=table == "heap"):
                _execute(plan, backend, storage, cache, allow_pickle, st, local_directory)
        except DstlError as exc:
            _discard(backend)
            raise _with_checkpoint(exc, plan.checkpoint) from exc
        except BaseException:
            _discard(backend)
            raise
    logger.info("restored backend %s (%s, key groups %s) from checkpoint %s: %d snapshot(s), "
                "%d entries, %d change sets, %d changes in %.3fs", plan.operator_id, table,
                key_groups, plan.checkpoint, len(plan.snapshots), st.get("entries", 0),
                st.get("change_sets", 0), st.get("changes", 0), st["total_seconds"])
    return backend


def _discard(backend: ChangelogKeyedStateBackend) -> None:
    """Close a backend whose restore failed and remove its LMDB table: nothing half-restored
    stays on the local disk for a later task to open (the restore created the table with
    ``clear_local``, so it is this restore's)."""
    path = backend.tables.path if backend.table_kind == "lmdb" else None
    backend.close()
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _check_arguments(handles: object, storage: object, key_groups: object, table: object,
                     cache: object, operator_id: object, max_parallelism: object,
                     options: object, local_directory: object, timer: object,
                     allow_pickle: object, stats: object, auto_materialize: object,
                     prefetch: object) -> None:
    """The arguments of :func:`restore_backend`, checked before anything is read (one place).

    Raises:
        ConfigError: a wrong value (ConfigTypeError: a wrong type).
    """
    owner = "restore_backend"
    if isinstance(handles, (str, bytes, bytearray)) or not isinstance(handles, Iterable):
        raise ConfigTypeError("handles", handles, "a list of handles (objects or their JSON), "
                              "one per backend of the checkpoint", owner=owner,
                              fix="wrap a single handle in a list: [handle]")
    check_storage(storage, "storage", owner)
    check_choice(table, "table", owner, ("heap", "lmdb"))
    check_instance(key_groups, "key_groups", owner, KeyGroupRange)
    if cache is not None:
        check_protocol(cache, "cache", owner, ("lease",),
                       "None or a restore.LeasingCache (e.g. restore.LocalFileCache)")
    if operator_id is not None:
        check_str(operator_id, "operator_id", owner)
    if max_parallelism is not None:
        check_layout(key_groups, max_parallelism, owner, table)
    if options is not None:
        check_instance(options, "options", owner, BackendOptions)
    check_optional_path(local_directory, "local_directory", owner)
    check_timer(timer, "timer", owner)
    check_bool(allow_pickle, "allow_pickle", owner)
    if stats is not None:
        check_instance(stats, "stats", owner, dict, fix="pass a restore.RestoreStats()")
    check_bool(auto_materialize, "auto_materialize", owner)
    check_bool(prefetch, "prefetch", owner)


def prefetch_items(plan: RestorePlan, options: BackendOptions,
                   max_change_set_bytes: int | None) -> list[PrefetchItem]:
    """Every object ``plan`` leases, once, in the order a restore leases them — the snapshots,
    then the segments in replay order — each with the verify function its lease passes."""
    snapshot = snapshot_verifier(options.max_snapshot_block_bytes)
    segment = segment_verifier(max_change_set_bytes)
    items: dict[str, PrefetchItem] = {}
    for ref in plan.snapshots:
        items.setdefault(ref.key, PrefetchItem(ref.key, snapshot, ref.size))
    for h in plan.logs:
        for cs in h.change_sets:
            if cs.key not in items:
                items[cs.key] = PrefetchItem(cs.key, segment)
    return list(items.values())


@contextlib.contextmanager
def _prefetching(plan: RestorePlan, storage: ChangelogStorage, cache: LeasingCache | None,
                 options: BackendOptions, st: RestoreStats) -> Iterator[None]:
    """The plan's objects prefetched through ``cache`` (none: nothing) while the block runs;
    what is left of the prefetch is cancelled when it ends, successful or not."""
    ticket = _start_prefetch(plan, storage, cache, options, st) if cache is not None else None
    try:
        yield
    finally:
        if ticket is not None:
            _end_prefetch(ticket)


def _start_prefetch(plan: RestorePlan, storage: ChangelogStorage, cache: LeasingCache,
                    options: BackendOptions, st: RestoreStats) -> PrefetchTicket | None:
    """Hand the plan's objects to the cache's prefetch; ``None`` when the cache has none or
    refused (a hint: the leases then download as they would without it)."""
    start = getattr(cache, "prefetch", None)
    if not callable(start):
        return None  # a LeasingCache of an older shape: lease() alone
    items = prefetch_items(plan, options, storage.options.max_change_set_bytes)
    st["prefetched_objects"] = len(items)
    if not items:
        return None
    try:
        ticket: PrefetchTicket = start(storage.store, items)
    except DstlError as exc:
        logger.warning("restore of checkpoint %s: prefetch refused by %r (%s); each object is "
                       "downloaded when it is reached", plan.checkpoint, cache, exc)
        return None
    return ticket


def _end_prefetch(ticket: PrefetchTicket) -> None:
    """Drop what the restore did not lease (it failed midway) and let its downloads end."""
    try:
        ticket.cancel()
    except DstlError as exc:
        logger.warning("cancelling a restore's prefetch failed (%s); its downloads end on their "
                       "own", exc)


def _execute(plan: RestorePlan, backend: ChangelogKeyedStateBackend, storage: ChangelogStorage,
             cache: LeasingCache | None, allow_pickle: bool, st: RestoreStats,
             local_directory: str | None = None) -> None:
    """Load the snapshots, replay the logs, install both as the backend's base."""
    t0 = time.monotonic()
    entries = _load_snapshots(plan, backend, storage.store, cache, allow_pickle, st,
                               local_directory)
    st["snapshots"] = len(plan.snapshots)
    st["entries"] = entries
    t1 = time.monotonic()
    _replay(backend, plan.logs, storage, cache, allow_pickle, st)
    t2 = time.monotonic()
    backend.install_restored(plan.snapshots, plan.logs, plan.materialization_id)
    st.update({"snapshot_seconds": t1 - t0, "replay_seconds": t2 - t1, "total_seconds": t2 - t0})


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

    verified = True   # the cache checked every byte (object crc; v1: every block) on download

    def __init__(self, cache: LeasingCache, store: BlobStore, key: str,
                 max_block_bytes: int | None = None) -> None:
        self._lease: ObjectLease = cache.lease(store, key,
                                               verify=snapshot_verifier(max_block_bytes))

    def size(self) -> int:
        return self._lease.size

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._lease.read(offset, length))

    def close(self) -> None:
        self._lease.release()


class _StoreSource(BlobRangeSource):
    """A snapshot's bytes by ranged reads of the store (v1 reads only the blocks it needs)."""

    verified = False

    def close(self) -> None:
        """Nothing is held."""


def _staging_parent(backend: ChangelogKeyedStateBackend, local_directory: str | None) -> str:
    """Where file snapshots are decompressed: beside the LMDB table (one filesystem, so the
    install is a rename), else the local directory or the system's temp directory."""
    if backend.table_kind == "lmdb":
        return str(os.path.dirname(backend.tables.path))
    return local_directory or tempfile.gettempdir()


def _load_snapshots(plan: RestorePlan, backend: ChangelogKeyedStateBackend, store: BlobStore,
                    cache: LeasingCache | None, allow_pickle: bool, st: RestoreStats,
                    local_directory: str | None = None) -> int:
    """Load every snapshot of the plan: v1 objects entry by entry as they come, v2 (file-level)
    ones staged, then installed together (:mod:`restore.file_restore`); returns the entries."""
    parent = _staging_parent(backend, local_directory)
    remove_stale_staging(parent)
    staged: list[StagedSnapshot] = []
    entries = 0
    any_v1 = False
    try:
        for ref in plan.snapshots:
            if ref.delta:
                continue   # applied below, on the full snapshots
            source = _snapshot_source(backend, store, cache, ref)
            try:
                head = source.read(0, min(8, source.size()))
                _check_piece_kind(ref, head)
                if is_file_snapshot(head):
                    if not source.verified:   # one GET of the whole object, verified here
                        source.close()
                        read, size = read_at(store, ref.key)
                    else:
                        read, size = source.read, source.size()
                    staged.append(stage_file_snapshot(ref, read, size, parent,
                                                      verified=source.verified))
                else:
                    any_v1 = True
                    entries += _load_snapshot(backend, ref, source, ref.key_groups,
                                              allow_pickle)
            finally:
                source.close()
        t = time.monotonic()
        entries += install_file_snapshots(backend, staged, plan.key_groups,
                                          whole_table=not any_v1, allow_pickle=allow_pickle)
        st["file_snapshots"] = len(staged)
        st["install_seconds"] = time.monotonic() - t
    finally:
        for s in staged:
            shutil.rmtree(s.directory, ignore_errors=True)
    t = time.monotonic()
    deltas = 0
    for i, ref in enumerate(plan.snapshots):
        if ref.delta:
            entries += _apply_delta(plan, i, backend, store, cache, allow_pickle)
            deltas += 1
    st["deltas"] = deltas
    st["delta_seconds"] = time.monotonic() - t
    return entries


def _snapshot_source(backend: ChangelogKeyedStateBackend, store: BlobStore,
                     cache: LeasingCache | None, ref: SnapshotRef
                     ) -> _CacheRangeSource | _StoreSource:
    return (_CacheRangeSource(cache, store, ref.key, backend.options.max_snapshot_block_bytes)
            if cache is not None else _StoreSource(store, ref.key))


def _check_piece_kind(ref: SnapshotRef, head: bytes) -> None:
    """The object is what the handle says: a delta (format v3) or a full snapshot (v1, v2) —
    a full snapshot read as a delta, or the reverse, would give a wrong state."""
    version = snapshot_version(head)
    if ref.delta != (version == DELTA_VERSION):
        raise CorruptObjectError(
            ref.key, 5, f"the checkpoint names a {'delta' if ref.delta else 'full snapshot'} "
                        f"but the object's format version is {version}",
            hint="the handle does not match the object; restore from an earlier checkpoint")


def check_delta_piece(ref: SnapshotRef, meta: DeltaMeta, at: int,
                      earlier: Sequence[SnapshotRef], max_parallelism: int) -> None:
    """A delta is the piece its reference names, in the chain the checkpoint names: it follows
    the piece before it for its key groups (the last of ``earlier`` covering its first key
    group), is the materialization its reference names, has the checkpoint's max parallelism and
    covers the reference's key groups — what every reader of a chain checks (restore, the row
    and column readers, the change feed), since a delta with valid checksums can still claim any
    of these.

    Raises:
        CorruptObjectError: naming the delta and its metadata block (``at``).
    """
    before = next((p for p in reversed(earlier) if ref.key_groups.start in p.key_groups), None)
    if before is None or meta.follows != before.materialization_id:
        raise CorruptObjectError(
            ref.key, at, f"the delta follows materialization {meta.follows}, but the piece "
                         f"before it for key groups {ref.key_groups} is "
                         f"{'none' if before is None else before.materialization_id}")
    if (meta.materialization_id != ref.materialization_id
            or meta.max_parallelism != max_parallelism
            or ref.key_groups.intersection(meta.key_groups) != ref.key_groups):
        raise CorruptObjectError(
            ref.key, at, f"the delta is materialization {meta.materialization_id} of key "
                         f"groups {meta.key_groups} at max parallelism "
                         f"{meta.max_parallelism}; the checkpoint names materialization "
                         f"{ref.materialization_id} of {ref.key_groups} at "
                         f"{max_parallelism}")


def _apply_delta(plan: RestorePlan, i: int, backend: ChangelogKeyedStateBackend,
                 store: BlobStore, cache: LeasingCache | None, allow_pickle: bool) -> int:
    """Apply the delta ``plan.snapshots[i]`` (for its key groups) on the pieces before it;
    returns the entries applied."""
    ref = plan.snapshots[i]
    source = _snapshot_source(backend, store, cache, ref)
    try:
        _check_piece_kind(ref, source.read(0, min(8, source.size())))
        reader = DeltaReader(source, key=ref.key,
                             max_block_bytes=backend.options.max_snapshot_block_bytes)
        meta, at = reader.meta, reader.metadata_offset
        check_delta_piece(ref, meta, at, plan.snapshots[:i], plan.max_parallelism)
        remap: dict[int, int] = {}
        for sid, state in sorted(meta.states.items()):
            try:
                remap[int(sid)] = backend.register_restored_state(state, int(sid),
                                                                  allow_pickle=allow_pickle)
            except (DstlError, *DECODER_BUGS) as exc:
                raise placed(exc, ref.key, at, f"delta metadata of state {sid}") from exc
        applied = 0
        with backend.bulk_restore() as loader:
            for kg, offset, block in reader.read(ref.key_groups):
                try:
                    if loader is not None:
                        loader.step(0)
                    applied += backend.apply_delta_entries(kg, block, remap, loader)
                except (DstlError, *DECODER_BUGS) as exc:
                    raise placed(exc, ref.key, offset, f"delta block of key group {kg}") from exc
        return applied
    except DECODER_BUGS as exc:
        raise placed(exc, ref.key, 0, "delta") from exc
    finally:
        source.close()


def _load_snapshot(backend: ChangelogKeyedStateBackend, ref: SnapshotRef, source: RangeSource,
                   key_groups: KeyGroupRange, allow_pickle: bool) -> int:
    """Register a v1 snapshot's states and load its blocks of ``key_groups``; return the entry
    count."""
    reader = SnapshotReader(source, key=ref.key,
                            max_block_bytes=backend.options.max_snapshot_block_bytes)
    remap = _register_snapshot_states(backend, reader, ref.key, allow_pickle)
    entries = 0
    for kg, offset, block in reader.read_located(key_groups.intersection(reader.key_groups)):
        try:
            entries += backend.load_snapshot_entries(kg, block, remap)
        except (DstlError, *DECODER_BUGS) as exc:
            raise placed(exc, ref.key, offset, f"block of key group {kg}") from exc
    return entries


def _register_snapshot_states(backend: ChangelogKeyedStateBackend, reader: SnapshotReader,
                              key: str, allow_pickle: bool) -> dict[int, int]:
    """The snapshot's state registry, registered in ``backend``: snapshot id -> backend id."""
    offset = reader.metadata_offset
    states = decode_snapshot_states(reader.metadata, key=key, offset=offset)
    remap: dict[int, int] = {}
    for sid, meta in states.items():
        try:
            remap[sid] = backend.register_restored_state(meta, sid, allow_pickle=allow_pickle)
        except (DstlError, *DECODER_BUGS) as exc:
            raise placed(exc, key, offset, f"snapshot metadata of state {sid}") from exc
    return remap


def _check_scope(blocks: Sequence[tuple[int, int, int]], scope: KeyGroupRange,
                 h: ChangelogHandle, ref: ChangeSetRef, backend: ChangelogKeyedStateBackend
                 ) -> None:
    """The reader filters by ``scope``; a block outside it means the filter failed: corrupt,
    never applied."""
    for kg, _, _ in blocks:
        if kg != META_KEY_GROUP and kg not in scope:
            raise CorruptObjectError(
                ref.key, ref.offset, f"change set ({h.log_id!r}, sqn {ref.sqn}) gave key group "
                f"{kg} for a replay of {scope} only (backend {backend.operator_id!r} owns "
                f"{backend.key_groups})")


def _replay(backend: ChangelogKeyedStateBackend, logs: Sequence[ChangelogHandle],
            storage: ChangelogStorage, cache: LeasingCache | None, allow_pickle: bool,
            st: RestoreStats) -> None:
    """Apply the planned change sets block by block (:mod:`materializer.replay`), each for the
    key groups it is planned for only, inside the table's bulk-restore batch; every error names
    the segment, the record and the change set."""
    reader = ChangelogReader(storage, cache=cache,
                             max_change_set_bytes=storage.options.max_change_set_bytes)
    changes = 0
    sets = 0
    # a log's state ids, by log (the same log id may name writers of different ranges)
    remaps: dict[tuple[str, KeyGroupRange], dict[int, int]] = {}
    with backend.bulk_restore() as loader:
        for h in logs:
            remap = remaps.setdefault((h.log_id, h.key_groups), {})
            replayer = BlockReplayer(backend, loader, remap, allow_pickle)
            scope = h.replay_key_groups
            for ref, body, blocks in reader.read_blocks(h, key_groups=scope):
                _check_scope(blocks, scope, h, ref, backend)
                try:
                    if loader is not None:
                        loader.step(len(body))
                    changes += replayer.apply(body, blocks, ref.key, ref.offset)
                except (DstlError, *DECODER_BUGS) as exc:
                    raise placed(exc, ref.key, ref.offset,
                                  f"key group {replayer.key_group} of change set "
                                  f"({h.log_id!r}, sqn {ref.sqn})") from exc
            sets += len(h)
    st["change_sets"] = sets
    st["changes"] = changes
