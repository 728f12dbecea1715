"""State rows of a checkpoint: restore one split read-only, then walk every state.

Theory of operation
-------------------
A split (:class:`~dstl.reader.plan.StateSplit`: one task's backend handle, a key-group range)
is read by the same code a job restores with — :func:`restore.restore_backend`: the snapshot
blocks of the split's key groups only (ranged reads, or whole objects through a
:class:`~restore.LocalFileCache` shared by the process's splits), then the log after them. The
backend it builds lives in this process (a heap table by default, or LMDB in a temporary
directory for states larger than memory) on a :class:`~dstl.ChangelogStorage` whose store is a
:class:`~dstl.reader.store.ReadOnlyBlobStore`: the restored backend's writer exists but nothing
is appended (replay does not log), and any write would be refused rather than reach the job's
store. The storage uses a manual timer, so a read starts no timer thread.

The rows are then every entry of every registered state, state by state and key group by key
group (:class:`~dstl.reader.rows.StateRow`; map states one row per map entry), decoded with the
codecs the state's metadata names — ``pickle`` only with ``allow_pickle``.

A checkpoint of a running job can be deleted by its retention while a split reads it; a missing
object is then re-checked against the manifest: gone too is
:class:`~dstl.reader.errors.CheckpointDeletedError`, still there is an
:class:`~dstl.errors.ObjectNotFoundError` naming the object and the checkpoint (a damaged store).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from dstl.checks import check_bool, check_instance
from dstl.errors import ObjectNotFoundError
from dstl.keygroups import KeyGroupRange
from dstl.layout import MANIFEST_PREFIX
from dstl.reader.checks import check_cache, check_key_bytes, check_names, check_table
from dstl.reader.errors import CheckpointDeletedError
from dstl.reader.image import StateImage, StateInfo, stream_snapshots
from dstl.reader.plan import StateSplit
from dstl.reader.rows import StateRow
from dstl.reader.store import ReadOnlyBlobStore
from dstl.storage import ChangelogStorage
from dstl.stores.base import BlobStore
from dstl.timer import ManualTimer
from materializer.backend import ChangelogKeyedStateBackend
from materializer.codecs import SafeCodec, StrOrBytesKeyCodec
from materializer.handles import ChangelogStateBackendHandle
from restore.leasing import LeasingCache
from restore.reader import ChangelogReader
from restore.restore import plan_restore, restore_backend

__all__ = ["entries", "read_state_split", "restored", "translate_missing"]

#: The operator id of the backends a reader restores (never written anywhere).
_READER_ID = "dstl-reader"
_KEYS = StrOrBytesKeyCodec()
_SAFE = SafeCodec()  # namespaces (b"": the default namespace)


def _read_only(store: BlobStore) -> ReadOnlyBlobStore:
    """A view that refuses writes and whose ``close`` (the storage closes its store) leaves
    ``store`` open for the caller's next split."""
    return ReadOnlyBlobStore(store.inner if isinstance(store, ReadOnlyBlobStore) else store)


@contextlib.contextmanager
def restored(store: BlobStore, handles: Sequence[ChangelogStateBackendHandle],
             key_groups: KeyGroupRange, *, cache: LeasingCache | None = None,
             table: str = "heap", allow_pickle: bool = False
             ) -> Iterator[ChangelogKeyedStateBackend]:
    """A backend holding ``handles``' state of ``key_groups``, restored read-only (see the
    module docstring); closed when the block ends. With no handles, an empty backend."""
    storage = ChangelogStorage(store=_read_only(store), timer=ManualTimer())
    backend: ChangelogKeyedStateBackend | None = None
    try:
        if handles:
            # one id for however many handles meet the range (after a rescale: several)
            backend = restore_backend(handles, storage, key_groups, table=table, cache=cache,
                                      operator_id=_READER_ID, allow_pickle=allow_pickle,
                                      auto_materialize=False)
        else:
            backend = ChangelogKeyedStateBackend(storage, _READER_ID, key_groups,
                                                 key_groups.end + 1, table=table,
                                                 auto_materialize=False)
        yield backend
    finally:
        if backend is not None:
            backend.close()
        storage.close()


def translate_missing(store: BlobStore, checkpoint_id: int, exc: ObjectNotFoundError
                      ) -> ObjectNotFoundError:
    """The error for an object found missing while reading ``checkpoint_id``: the checkpoint was
    deleted (its manifest is gone too), or the store is damaged."""
    prefix = f"{MANIFEST_PREFIX}{checkpoint_id:016x}-"
    key = exc.key or "?"
    if next(iter(store.list(prefix)), None) is None:
        return CheckpointDeletedError(checkpoint_id, key, store.location)
    return ObjectNotFoundError(f"{exc} (checkpoint {checkpoint_id} still exists, but an object "
                               "it names is missing: the store is damaged; run dstl verify)",
                               key=key)


def entries(backend: ChangelogKeyedStateBackend, key_groups: KeyGroupRange,
            states: Collection[str] | None = None
            ) -> Iterator[tuple[str, str, int, Any, bytes, Any, Any]]:
    """``(state, kind, key group, key, key bytes, namespace, value)`` of every entry, decoded."""
    heap = backend.table_kind == "heap"
    tables = backend.tables
    for sid, meta in backend.state_metadata().items():
        name, kind = meta["name"], meta["kind"]
        if meta.get("raw") is True or (states is not None and name not in states):
            continue  # raw: an internal index (no codecs), as in the state image
        for kg in key_groups:
            for k, ns, v in tables.entries(sid, kg):
                if heap:
                    yield name, kind, kg, k, k.encode("utf-8") if type(k) is str else k, ns, v
                else:
                    key, namespace, value = backend.decode_entry(sid, k, ns, v)
                    yield name, kind, kg, key, k, namespace, value


def read_state_split(store: BlobStore, split: StateSplit, *, cache: LeasingCache | None = None,
                     table: str = "heap", allow_pickle: bool = False,
                     keys: Collection[bytes] | None = None,
                     states: Collection[str] | None = None) -> Iterator[StateRow]:
    """The state rows of one split.

    Args:
        store: the job's store (wrapped read-only here if it is not already).
        split: from :func:`~dstl.reader.plan.plan_state_splits`.
        cache: a restore cache shared by the process's reads, or ``None`` for ranged reads.
        table: ``"heap"``: the split's state in memory (:mod:`dstl.reader.image`: snapshot
            entries streamed as they are when no log follows them, else held as stored bytes
            while the log is applied); ``"lmdb"``: restored into a temporary LMDB directory
            (:func:`restored`), for splits larger than memory.
        allow_pickle: decode states whose codec is ``pickle`` (runs code from the store).
        keys: only these keys (their key-codec bytes).
        states: only these state names.

    Raises:
        CheckpointDeletedError: the checkpoint was deleted while it was read.
        ObjectNotFoundError, CorruptObjectError: a needed object is missing or damaged.
        UsageError: a state uses the pickle codec and ``allow_pickle`` is off.
        ConfigError: an argument of the wrong type or out of range (raised by the call).
    """
    owner = "read_state_split"
    check_instance(split, "split", owner, StateSplit)
    check_table(table, owner)
    check_bool(allow_pickle, "allow_pickle", owner)
    check_cache(cache, owner)
    keys = check_key_bytes(keys, owner)
    states = check_names(states, "states", owner)
    handle = ChangelogStateBackendHandle.from_json(split.handle)
    return _split_rows(store, split, handle, cache, table, allow_pickle, keys, states)


def _split_rows(store: BlobStore, split: StateSplit, handle: ChangelogStateBackendHandle,
                cache: LeasingCache | None, table: str, allow_pickle: bool,
                keys: Collection[bytes] | None, states: Collection[str] | None
                ) -> Iterator[StateRow]:
    try:
        if table == "lmdb":
            yield from _restored_rows(store, split, handle, cache, allow_pickle, keys, states)
        else:
            yield from _image_rows(store, split, handle, cache, allow_pickle, keys, states)
    except ObjectNotFoundError as exc:
        raise translate_missing(store, split.checkpoint_id, exc) from exc


def _image_rows(store: BlobStore, split: StateSplit, handle: ChangelogStateBackendHandle,
                cache: LeasingCache | None, allow_pickle: bool, keys: Collection[bytes] | None,
                states: Collection[str] | None) -> Iterator[StateRow]:
    rng = split.key_group_range
    plan = plan_restore([handle], rng)  # narrowed to what the handle owns in the range
    logs = [h for h in plan.logs if h.change_sets]
    source: Iterator[tuple[StateInfo, int, bytes, bytes, bytes]]
    if not logs and not any(r.delta for r in plan.snapshots):
        source = stream_snapshots(store, plan.snapshots, rng, allow_pickle, cache)
    else:
        image = StateImage(allow_pickle)
        image.load(store, plan.snapshots, rng, cache, max_parallelism=plan.max_parallelism)
        reader = ChangelogReader(store, cache=cache)
        for h in logs:
            image.replay(reader, h, rng.intersection(h.replay_key_groups))
        source = image.rows()
    cp, task = split.checkpoint_id, split.task_id
    key_of, ns_of = _KEYS.decode, _SAFE.decode
    for info, kg, kb, nb, vb in source:
        if info.raw or (states is not None and info.name not in states) or (
                keys is not None and kb not in keys):
            continue
        key, ns, value = key_of(kb), ns_of(nb) if nb else None, info.shape.from_bytes(vb)
        if info.kind == "map":
            for uk, uv in value.items():
                yield StateRow(cp, task, kg, key, kb, info.name, "map", ns, uk, uv)
        else:
            yield StateRow(cp, task, kg, key, kb, info.name, info.kind, ns, None, value)


def _restored_rows(store: BlobStore, split: StateSplit, handle: ChangelogStateBackendHandle,
                   cache: LeasingCache | None, allow_pickle: bool,
                   keys: Collection[bytes] | None, states: Collection[str] | None
                   ) -> Iterator[StateRow]:
    rng = split.key_group_range
    cp, task = split.checkpoint_id, split.task_id
    with restored(store, [handle], rng, cache=cache, table="lmdb",
                  allow_pickle=allow_pickle) as backend:
        for name, kind, kg, key, kb, ns, value in entries(backend, rng, states):
            if keys is not None and kb not in keys:
                continue
            if kind == "map":
                for uk, uv in value.items():
                    yield StateRow(cp, task, kg, key, kb, name, kind, ns, uk, uv)
            else:
                yield StateRow(cp, task, kg, key, kb, name, kind, ns, None, value)
