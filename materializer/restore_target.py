"""``RestoreTarget``: how a restore fills a keyed backend's table — snapshot entries, delta
entries and logged changes, applied WITHOUT being logged again.

Theory of operation
-------------------
- **Metadata first.** A metadata record (key group -1) registers its state
  (:meth:`~materializer.state_registry.StateRegistry.register_restored`) and, with a ``remap``,
  maps the log's state id to this backend's id for that name: backends merged by a rescale may
  have numbered their states differently. A change of a state id no record described is
  corruption.
- **Only owned key groups.** The restore hands over only the changes and entries of key groups
  this backend owns (it filters while reading); one of another key group is corruption, never
  skipped: skipping would hide a wrong plan or reader.
- **Forms.** The heap table holds objects (keys, namespaces and values decoded here); LMDB holds
  the stored bytes as they are; raw states hold bytes in either. What each change op does is
  the op table's (:func:`materializer.changes.apply_op`).

Implements :class:`~materializer.replay.ReplayTarget` (the bulk replay's target).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterable
from typing import Any, Protocol

from dstl.errors import CorruptObjectError, DstlError
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange
from materializer.changes import (
    CLEAR,
    OPS_BY_KIND,
    READS_CURRENT,
    SET,
    Change,
    apply_op,
    decode_change,
    decode_metadata,
)
from materializer.codecs import Codec
from materializer.delta_format import DeltaEntry
from materializer.replay import load_block
from materializer.state_access import NamespaceCodec, TableSide
from materializer.state_registry import Registration, StateRegistry

__all__ = ["RestoreTable", "RestoreTarget"]

_U32_PACK = struct.Struct(">I").pack


class RestoreTable(TableSide, Protocol):
    """What a restore needs of the backend's table side: the table, its kind and key groups, the
    codecs, and how a value that does not decode is named. Implemented by
    :class:`~materializer.state_access.StateTableAccess`."""

    def stored_value_error(self, exc: CorruptObjectError, sid: int, where: str) -> DstlError: ...


class RestoreTarget:
    """A backend's table as a restore fills it (see the module docstring).

    Args:
        access: the backend's table side (its table, codecs and key groups).
        registry: the backend's states.
    """

    def __init__(self, access: RestoreTable, registry: StateRegistry) -> None:
        self._access = access
        self._registry = registry
        self._by_id = registry.by_id
        self._raw = registry.raw
        self._heap = access.table_kind == "heap"
        self.key_groups: KeyGroupRange = access.key_groups

    # ------------------------------------------------------------------ ReplayTarget

    @property
    def key_codec(self) -> Codec:
        return self._access.key_codec

    @property
    def namespace_codec(self) -> NamespaceCodec:
        return self._access.namespace_codec

    @property
    def tables(self) -> Any:
        return self._access.tables

    def is_raw_state(self, state_id: int) -> bool:
        return state_id in self._raw

    def registered_state(self, state_id: int) -> Registration | None:
        return self._by_id.get(state_id)

    def bulk_restore(self) -> contextlib.AbstractContextManager[Any]:
        """LMDB's :class:`~materializer.lmdb_table.LmdbBulkLoad` (commits as it goes), ``None``
        for the heap (writes are immediate)."""
        if self._heap:
            return contextlib.nullcontext(None)
        return self._access.tables.bulk_load()  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ logged changes

    def apply_change(self, key_group: int, payload: bytes, *, remap: dict[int, int] | None = None,
                     allow_pickle: bool = False) -> None:
        """Apply one logged change to the table without logging it again (see the module
        docstring).

        Raises:
            CorruptObjectError: malformed record, a change before its state's metadata, or a
                change of a key group outside this backend's range.
            StateError: the log names a state with a different kind than this backend knows.
        """
        if key_group == META_KEY_GROUP:
            sid, meta = decode_metadata(payload)
            new = self._registry.register_restored(meta, sid, allow_pickle=allow_pickle)
            if remap is not None:
                remap[sid] = new
            return
        if not self.key_groups.start <= key_group <= self.key_groups.end:
            raise CorruptObjectError("<changelog>", 0, f"a change of key group {key_group} was "
                                                       "handed to backend "
                                                       f"{self._access.operator_id!r}, "
                                                       f"which owns {self.key_groups}")
        ch = decode_change(payload)
        sid = ch.state_id if remap is None else remap.get(ch.state_id, -1)
        reg = self._by_id.get(sid)
        if reg is None:
            raise CorruptObjectError("<change>", 1, f"change for state id {ch.state_id} "
                                                    "before its metadata record")
        if ch.op not in OPS_BY_KIND[reg.shape.kind]:
            raise CorruptObjectError("<change>", 0, f"op {ch.op} is not an operation of "
                                                    f"{reg.shape.kind} state {reg.meta['name']!r}")
        self._apply(key_group, reg, ch)

    def _apply(self, kg: int, reg: Registration, ch: Change) -> None:
        t, shape, sid = self._access.tables, reg.shape, reg.state_id
        if sid in self._raw:
            self._apply_raw(kg, sid, ch)
            return
        key: Any = ch.key
        ns: Any = ch.namespace
        if self._heap:
            key = self._access.key_codec.decode(ch.key)
            ns = self._access.namespace_codec.decode(ch.namespace)
        op = ch.op  # what it does: the op table (materializer.changes.apply_op)
        cur = t.get(sid, kg, key, ns) if op in READS_CURRENT else None
        new = apply_op(op, shape, cur, ch.payload, objects=self._heap)
        if new is None:
            t.remove(sid, kg, key, ns)
        else:
            t.put(sid, kg, key, ns, new)

    def _apply_raw(self, kg: int, sid: int, ch: Change) -> None:
        """Replay one change of a raw state: bytes in, bytes stored, in either table."""
        t = self._access.tables
        if ch.op == CLEAR:
            t.remove(sid, kg, ch.key, ch.namespace)
        elif ch.op == SET:
            t.put(sid, kg, ch.key, ch.namespace, ch.payload)
        else:
            raise CorruptObjectError("<changelog>", 0, f"op code {ch.op} on raw state {sid}")

    # ------------------------------------------------------------------ snapshot entries

    def load_snapshot_entries(self, key_group: int, entries: Iterable[Any],
                              remap: dict[int, int]) -> int:
        """Put snapshot entries ``(state_id, key, namespace, value)`` (bytes) of one key group
        into the table, mapping state ids with ``remap``; returns the count
        (:func:`materializer.replay.load_block`)."""
        return load_block(self, key_group, entries, remap)

    def apply_delta_entries(self, key_group: int, entries: Iterable[DeltaEntry],
                            remap: dict[int, int], loader: Any = None) -> int:
        """Apply a delta's entries ``(state id, key, namespace, value)`` (bytes; value
        ``None``: a tombstone) of one key group to the table, mapping state ids with ``remap``;
        returns the count. ``loader``: the LMDB table's bulk load (:meth:`bulk_restore`), which
        takes the block's puts as one run of records.

        Raises:
            CorruptObjectError: an entry of a state id the delta's metadata does not describe,
                or a key group this backend does not own (named ``<delta entry>``; the loader
                names the object).
        """
        if key_group not in self.key_groups:
            raise CorruptObjectError("<delta entry>", 0, f"key group {key_group} is not owned "
                                                         "by backend "
                                                         f"{self._access.operator_id!r}")
        t = self._access.tables
        n = 0
        if loader is not None and not self._heap:
            # the stored bytes as they are: one run of records, tombstones one by one (a
            # delta holds each entry once, so their order does not matter)
            records: list[tuple[bytes, bytes]] = []
            prefixes: dict[int, bytes] = {}
            for sid0, k, ns, v in entries:
                sid = remap.get(sid0, -1)
                if sid not in self._by_id:
                    raise CorruptObjectError("<delta entry>", 0, f"state id {sid0} is not "
                                                                 "described by the delta's "
                                                                 "metadata")
                if v is None:
                    t.remove(sid, key_group, k, ns)
                else:
                    prefix = prefixes.get(sid)
                    if prefix is None:
                        prefix = prefixes[sid] = loader.prefix(key_group, sid)
                    records.append((prefix + _U32_PACK(len(k)) + k + ns, v))
                n += 1
            loader.put_raw(records)
            return n
        key_codec, ns_codec = self._access.key_codec, self._access.namespace_codec
        for sid0, k, ns, v in entries:
            sid = remap.get(sid0, -1)
            reg = self._by_id.get(sid)
            if reg is None:
                raise CorruptObjectError("<delta entry>", 0, f"state id {sid0} is not described "
                                                             "by the delta's metadata")
            if self._heap and sid not in self._raw:
                tk: Any = key_codec.decode(k)
                tn: Any = ns_codec.decode(ns)
            else:
                tk, tn = k, ns
            if v is None:
                t.remove(sid, key_group, tk, tn)
            else:
                t.put(sid, key_group, tk, tn,
                      reg.shape.from_bytes(v) if self._heap and sid not in self._raw else v)
            n += 1
        return n

    def decode_entry(self, sid: int, key: bytes, ns: bytes, value: bytes
                     ) -> tuple[Any, Any, Any]:
        """Inverse of the snapshot encoder (a heap restore's, and a reader's of an LMDB
        table's stored entries)."""
        if sid in self._raw:
            return key, ns, value
        a = self._access
        try:
            return (a.key_codec.decode(key), a.namespace_codec.decode(ns),
                    self._by_id[sid].shape.from_bytes(value))
        except CorruptObjectError as exc:
            if self._heap:
                raise   # a restore's input: it names the object
            raise a.stored_value_error(exc, sid, f"stored key {key[:40]!r}") from exc
