"""Bulk log replay: a change set applied one key-group block at a time, not one change at a time.

Theory of operation
-------------------
A change-set body is a list of key-group blocks (:func:`dstl.segment.body_blocks`), each the
concatenated ``u32 len | change`` records of one key group in append order, a change being
``u8 op | u16 state id | u32 key length | key | u32 namespace length | namespace | payload``
(:mod:`materializer.changes`). The per-change replay (``backend.apply_change``) decodes every
change into a ``Change`` object, dispatches on its op and writes through the table's per-entry
``put``: about twenty Python calls per change. :class:`BlockReplayer` walks a block's bytes in
one loop instead, with one ``struct`` call and three slices per change:

* **LMDB**: the table stores keys in its own layout ``u16 key group | u16 state id | u32 key
  length | key | namespace`` and values as the encoded bytes the log holds, so a SET's record is
  ``prefix + body[key length .. key end] + namespace`` and its value is the payload slice — no
  decoding, no re-encoding. Records are collected per block and stored with one ``putmulti``
  (:meth:`~materializer.lmdb_table.LmdbBulkLoad.put_raw`) in their order, so a later change of a
  key overwrites an earlier one exactly as the per-change path does.
* **Heap**: key, namespace and value are decoded (the value through the state's codec, whose
  scalar fast path makes a small int one comparison; a raw state — an internal index — keeps its
  bytes, :func:`heap_decoders`) and a run of SETs of one state goes into the key group's map with
  :meth:`~materializer.cow_map.CopyOnWriteStateMap.put_all`.

*Uniform blocks* — every change a SET of one state with one key length, no namespace and one
total length, which is what a job with fixed-width keys and values writes (the count job: keys
``k%08d``, small-int counts) — skip even that loop: :func:`uniform_block` proves the fixed
stride with strided byte comparisons and ``struct.iter_unpack`` cuts every change at once, so
the per-change work is one tuple and one concatenation (LMDB) or the decoders (heap). Anything
else in the block, however small, sends the whole block through the loop.

Everything that is not a plain SET (``SET``/``SET_INTERNAL``) — CLEAR, the merging ops, an
unknown op — first flushes the pending run and then goes through ``backend.apply_change``, as do
the metadata block (key group -1) and any key group outside the backend's range, so their
semantics (and errors) are the per-change path's by construction and the order of all writes is
the log's. The framing checks are the per-change path's too: a change must fit in its block and
its key and namespace in the change (a typed :class:`~dstl.errors.CorruptObjectError` naming
the segment and the record's offset otherwise), and a change of a state whose metadata was not
replayed first is refused the same way.

Exactly-once is the caller's (the restore plan hands every change set once per key group); this
module applies what it is given once, in order.
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Iterable
from typing import Any, Final, Protocol

from dstl.errors import CorruptObjectError, TruncatedObjectError
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange
from materializer.changes import OP_SID
from materializer.changes import SET as _SET
from materializer.changes import SET_INTERNAL as _SET_INTERNAL
from materializer.codecs import Codec
from materializer.snapshot_format import (
    BLOCK_ENTRIES_OFFSET,
    ENTRY_HEAD,
    ENTRY_MIN_BYTES,
    BlockEntries,
    block_framing_error,
)
from materializer.states import RegisteredState

__all__ = ["BlockReplayer", "ReplayTarget", "load_block"]

#: Change length, op, state id, key length: the first 11 bytes of a ``u32 len | change`` record
#: (the segment's length prefix, then the change's own head: :mod:`materializer.changes`).
_HEAD: Final = struct.Struct(">I" + OP_SID.format.lstrip(">") + "I")
_U32: Final = struct.Struct(">I")
# SET and SET_INTERNAL are adjacent codes: ``_SET <= op <= _SET_INTERNAL`` is "store this value"
#: Below this many changes a block goes through the loop (the uniform check would not pay).
_MIN_UNIFORM: Final = 8


@functools.lru_cache(maxsize=256)
def _uniform_struct(skip: int, klen: int, vlen: int) -> struct.Struct:
    """One change of a uniform block cut into (key field, value): ``skip`` header bytes, the
    key field (with or without its length), the 4-byte zero namespace length, the value."""
    return struct.Struct(f">{skip}x{klen}s4x{vlen}s")


def uniform_block(body: bytes, pos: int, end: int) -> tuple[int, int, int] | None:
    """``(state id, key length, value length)`` if the changes of ``body[pos:end]`` are
    *uniform* — every change a SET/SET_INTERNAL of one state, with one key length, no
    namespace and one total length, as a job with fixed-width keys and values writes them;
    ``None`` otherwise (or for a block too small to be worth it).

    Uniform changes sit at a fixed stride, so ``struct.iter_unpack`` cuts them all at once (C,
    no bytecode per change: :func:`uniform_changes`). That the stride is the true framing is
    proved, not assumed: byte ``j`` of every change's 11-byte head (length, op, state id, key
    length) must equal byte ``j`` of the first change's — each change's length is then the
    stride, so the changes chain exactly as the per-change parse would walk them — and every
    namespace length must be zero. The checks are strided slices compared in C (``body[j::
    stride]``). Any difference returns ``None``, and the per-change loop decides, with its own
    errors."""
    size = end - pos
    if size < 15:
        return None
    ln, op, sid, klen = _HEAD.unpack_from(body, pos)
    stride = 4 + ln
    vlen = ln - 11 - klen
    if (not _SET <= op <= _SET_INTERNAL or vlen < 0 or size % stride
            or size // stride < _MIN_UNIFORM):
        return None
    count = size // stride
    for j in range(11):
        if body[pos + j:end:stride] != body[pos + j:pos + j + 1] * count:
            return None
    ns = pos + 11 + klen
    zero = b"\0" * count
    for j in range(4):
        if body[ns + j:end:stride] != zero:
            return None
    return sid, klen, vlen


def uniform_changes(body: bytes, pos: int, end: int, klen: int, vlen: int,
                    with_length: bool) -> Iterable[tuple[bytes, bytes]]:
    """``(key, value)`` of every change of a uniform block (:func:`uniform_block`); the key
    with its 4-byte length field in front if ``with_length`` (the LMDB record's layout)."""
    fmt = (_uniform_struct(7, 4 + klen, vlen) if with_length
           else _uniform_struct(11, klen, vlen))
    return fmt.iter_unpack(memoryview(body)[pos:end])


class ReplayTarget(Protocol):
    """What a restore's bulk load and replay need of the backend they fill: its key groups and
    codecs, the registrations of its states, its table, the bulk write batch, and the
    one-change path that does not log again. Implemented by
    :class:`~materializer.restore_target.RestoreTarget` and by the backend, which delegates to
    it."""

    key_groups: KeyGroupRange

    @property
    def key_codec(self) -> Codec: ...

    @property
    def namespace_codec(self) -> Any: ...

    @property
    def tables(self) -> Any: ...

    def is_raw_state(self, state_id: int) -> bool: ...

    def registered_state(self, state_id: int) -> RegisteredState | None: ...

    def bulk_restore(self) -> contextlib.AbstractContextManager[Any]: ...

    def apply_change(self, key_group: int, payload: bytes, *, remap: dict[int, int] | None = None,
                     allow_pickle: bool = False) -> None: ...


class BlockReplayer:
    """Applies change-set blocks to one backend during a restore (see the module docstring).

    Args:
        backend: the restoring :class:`~materializer.backend.ChangelogKeyedStateBackend`.
        loader: the LMDB table's open :class:`~materializer.lmdb_table.LmdbBulkLoad`, or
            ``None`` for the heap.
        remap: the log's state ids -> the backend's (filled by its metadata records), or None.
        allow_pickle: passed to the metadata records' registration.
    """

    def __init__(self, backend: ReplayTarget, loader: Any, remap: dict[int, int] | None,
                 allow_pickle: bool) -> None:
        self._b = backend
        self._loader = loader
        self._remap = remap
        self._allow_pickle = allow_pickle
        self._start = backend.key_groups.start
        self._end = backend.key_groups.end
        #: the key group of the block being applied (for the caller's error messages)
        self.key_group = META_KEY_GROUP

    def apply(self, body: bytes, blocks: list[tuple[int, int, int]], key: str,
              offset: int) -> int:
        """Apply the ``(key group, start, end)`` blocks of ``body`` (a verified change-set body
        from segment ``key`` at record ``offset``) in order; return the number of changes."""
        n = 0
        for kg, start, end in blocks:
            self.key_group = kg
            if kg == META_KEY_GROUP or not self._start <= kg <= self._end:
                n += self._per_change(kg, body, start, end, key, offset)
            elif self._loader is not None:
                n += self._lmdb_block(kg, body, start, end, key, offset)
            else:
                n += self._heap_block(kg, body, start, end, key, offset)
        return n

    def _one(self, kg: int, payload: bytes) -> None:
        self._b.apply_change(kg, payload, remap=self._remap, allow_pickle=self._allow_pickle)

    def _per_change(self, kg: int, body: bytes, pos: int, end: int, key: str,
                    offset: int) -> int:
        """The per-change path for a whole block (metadata, foreign key groups)."""
        n = 0
        unpack = _U32.unpack_from
        while pos < end:
            if end - pos < 4:
                raise TruncatedObjectError(key, offset, pos + 4, end, "change length")
            (ln,) = unpack(body, pos)
            cend = pos + 4 + ln
            if cend > end:
                raise TruncatedObjectError(key, offset, cend, end, "change payload")
            self._one(kg, body[pos + 4:cend])
            pos = cend
            n += 1
        return n

    def _registered(self, sid: int, key: str, offset: int) -> RegisteredState:
        """The backend's registration of the log's state id ``sid``."""
        new = sid if self._remap is None else self._remap.get(sid, -1)
        reg = self._b.registered_state(new)
        if reg is None:
            raise CorruptObjectError(key, offset, f"change for state id {sid} before its "
                                                  "metadata record")
        return reg

    def _lmdb_block(self, kg: int, body: bytes, pos: int, end: int, key: str,
                    offset: int) -> int:
        loader = self._loader
        uniform = uniform_block(body, pos, end)
        if uniform is not None:
            return self._lmdb_uniform(kg, body, pos, end, uniform, key, offset)
        prefixes: dict[int, bytes] = {}
        records: list[tuple[bytes, bytes]] = []
        append = records.append
        head = _HEAD.unpack_from
        u32 = _U32.unpack_from
        n = 0
        try:
            while pos < end:
                ln, op, sid, klen = head(body, pos)
                cend = pos + 4 + ln
                kend = pos + 11 + klen
                (nl,) = u32(body, kend)
                nend = kend + 4 + nl
                if nend > cend or cend > end:
                    raise _malformed(key, offset, kg, n, cend, end)
                if _SET <= op <= _SET_INTERNAL:
                    pre = prefixes.get(sid)
                    if pre is None:
                        pre = prefixes[sid] = loader.prefix(
                            kg, self._registered(sid, key, offset).state_id)
                    if nl:
                        append((pre + body[pos + 7:kend] + body[kend + 4:nend],
                                body[nend:cend]))
                    else:  # no namespace (the common case): one slice less
                        append((pre + body[pos + 7:kend], body[nend:cend]))
                else:
                    loader.put_raw(records)
                    records = []
                    append = records.append
                    self._one(kg, body[pos + 4:cend])
                pos = cend
                n += 1
        except struct.error as exc:
            raise TruncatedObjectError(key, offset, pos + 15, len(body),
                                       f"change {n} of key group {kg}") from exc
        loader.put_raw(records)
        return n

    def _lmdb_uniform(self, kg: int, body: bytes, pos: int, end: int,
                      uniform: tuple[int, int, int], key: str, offset: int) -> int:
        """A uniform block into LMDB: one record per change, cut by ``struct`` in C."""
        sid, klen, vlen = uniform
        pre = self._loader.prefix(kg, self._registered(sid, key, offset).state_id)
        records = [(pre + k, v) for k, v in uniform_changes(body, pos, end, klen, vlen, True)]
        self._loader.put_raw(records)
        return len(records)

    def _heap_uniform(self, kg: int, body: bytes, pos: int, end: int,
                      uniform: tuple[int, int, int], key: str, offset: int) -> int:
        """A uniform block into the heap: one ``put_all`` of the decoded changes."""
        sid, klen, vlen = uniform
        new_sid = self._registered(sid, key, offset).state_id
        kdec, _nsdec, vdec, no_ns = heap_decoders(self._b, new_sid)
        items = [(kdec(k), no_ns, vdec(v))
                 for k, v in uniform_changes(body, pos, end, klen, vlen, False)]
        self._b.tables.table(new_sid).map_for(kg).put_all(items)
        return len(items)

    def _heap_block(self, kg: int, body: bytes, pos: int, end: int, key: str,
                    offset: int) -> int:
        tables = self._b.tables
        uniform = uniform_block(body, pos, end)
        if uniform is not None:
            return self._heap_uniform(kg, body, pos, end, uniform, key, offset)
        run: list[tuple[Any, Any, Any]] = []
        run_sid = -1
        new_sid = -1
        kdec: Any = None
        nsdec: Any = None
        vdec: Any = None
        no_ns: Any = None
        head = _HEAD.unpack_from
        u32 = _U32.unpack_from
        n = 0
        try:
            while pos < end:
                ln, op, sid, klen = head(body, pos)
                cend = pos + 4 + ln
                kend = pos + 11 + klen
                (nl,) = u32(body, kend)
                nend = kend + 4 + nl
                if nend > cend or cend > end:
                    raise _malformed(key, offset, kg, n, cend, end)
                if _SET <= op <= _SET_INTERNAL:
                    if sid != run_sid:
                        if run:
                            tables.table(new_sid).map_for(kg).put_all(run)
                            run = []
                        reg = self._registered(sid, key, offset)
                        run_sid, new_sid = sid, reg.state_id
                        kdec, nsdec, vdec, no_ns = heap_decoders(self._b, new_sid)
                    run.append((kdec(body[pos + 11:kend]),
                                nsdec(body[kend + 4:nend]) if nl else no_ns,
                                vdec(body[nend:cend])))
                else:
                    if run:
                        tables.table(new_sid).map_for(kg).put_all(run)
                        run = []
                    self._one(kg, body[pos + 4:cend])
                pos = cend
                n += 1
        except struct.error as exc:
            raise TruncatedObjectError(key, offset, pos + 15, len(body),
                                       f"change {n} of key group {kg}") from exc
        if run:
            tables.table(new_sid).map_for(kg).put_all(run)
        return n


def load_block(backend: ReplayTarget, key_group: int, entries: Iterable[tuple[int, bytes, bytes, bytes]],
               remap: dict[int, int]) -> int:
    """Load one key group's snapshot entries ``(state id, key, namespace, value)`` into the
    backend's table in bulk (the snapshot-load counterpart of :class:`BlockReplayer`): heap runs
    of one state through ``put_all``, LMDB records through one ``putmulti``; returns the count.

    Raises:
        CorruptObjectError: an entry of a state id ``remap`` (the snapshot's metadata) lacks.
    """
    with backend.bulk_restore() as bulk:
        fused = type(entries) is BlockEntries and not entries.started
        if bulk is None:
            if fused:
                return _load_heap_content(backend, key_group, entries, remap)  # type: ignore[arg-type]
            return _load_heap(backend, key_group, entries, remap)
        if fused:
            return _load_lmdb_content(bulk, key_group, entries, remap)  # type: ignore[arg-type]
        return _load_lmdb(bulk, key_group, entries, remap)


def _unknown_state(key_group: int, index: int, sid: int) -> CorruptObjectError:
    return CorruptObjectError("<snapshot entry>", 0, f"entry {index} of key group {key_group} "
                                                     f"has state id {sid}, which the snapshot's "
                                                     "metadata does not describe")


def _load_heap(backend: ReplayTarget, key_group: int, entries: Iterable[tuple[int, bytes, bytes, bytes]],
               remap: dict[int, int]) -> int:
    tables = backend.tables
    run: list[tuple[Any, Any, Any]] = []
    run_sid = new = -1
    kdec: Any = None
    nsdec: Any = None
    vdec: Any = None
    no_ns: Any = None
    n = 0
    for sid, kb, nb, vb in entries:
        if sid != run_sid:
            if run:
                tables.table(new).map_for(key_group).put_all(run)
                run = []
            got = remap.get(sid)
            if got is None:
                raise _unknown_state(key_group, n, sid)
            run_sid, new = sid, got
            kdec, nsdec, vdec, no_ns = heap_decoders(backend, new)
        run.append((kdec(kb), nsdec(nb) if nb else no_ns, vdec(vb)))
        n += 1
    if run:
        tables.table(new).map_for(key_group).put_all(run)
    return n


def _load_lmdb(bulk: Any, key_group: int, entries: Iterable[tuple[int, bytes, bytes, bytes]],
               remap: dict[int, int]) -> int:
    prefixes: dict[int, bytes] = {}
    records: list[tuple[bytes, bytes]] = []
    append = records.append
    pack = _U32.pack
    for sid, kb, nb, vb in entries:
        pre = prefixes.get(sid)
        if pre is None:
            got = remap.get(sid)
            if got is None:
                raise _unknown_state(key_group, len(records), sid)
            pre = prefixes[sid] = bulk.prefix(key_group, got)
        append((pre + pack(len(kb)) + kb + nb, vb))
    bulk.put_raw(records)
    return len(records)


def _load_lmdb_content(bulk: Any, key_group: int, blk: BlockEntries,
                       remap: dict[int, int]) -> int:
    """:func:`_load_lmdb` parsing the block's content directly (no entry tuples): a record's key
    is the state's prefix, the content's ``u32 key length | key`` and the namespace. The
    framing checks (and the position an error names) are ``snapshot_format``'s own."""
    content, count = blk.content, blk.entry.entry_count
    end = len(content)
    pos = BLOCK_ENTRIES_OFFSET
    head = ENTRY_HEAD.unpack_from
    least, hsize = ENTRY_MIN_BYTES, ENTRY_HEAD.size
    u32 = _U32.unpack_from
    prefixes: dict[int, bytes] = {}
    records: list[tuple[bytes, bytes]] = []
    append = records.append
    for i in range(count):
        if end - pos < least:
            break
        sid, klen = head(content, pos)
        kend = pos + hsize + klen
        if end - kend < 8:
            pos += hsize
            break
        (nlen,) = u32(content, kend)
        nend = kend + 4 + nlen
        if end - nend < 4:
            pos = kend + 4
            break
        (vlen,) = u32(content, nend)
        vend = nend + 4 + vlen
        if vend > end:
            pos = nend + 4
            break
        pre = prefixes.get(sid)
        if pre is None:
            got = remap.get(sid)
            if got is None:
                raise _unknown_state(key_group, i, sid)
            pre = prefixes[sid] = bulk.prefix(key_group, got)
        append((pre + content[pos + 2:kend] + content[kend + 4:nend], content[nend + 4:vend]))
        pos = vend
    else:
        if pos == end:
            bulk.put_raw(records)
            return count
    raise block_framing_error(blk.key, blk.entry, end, pos)


def _load_heap_content(backend: ReplayTarget, key_group: int, blk: BlockEntries,
                       remap: dict[int, int]) -> int:
    """:func:`_load_heap` parsing the block's content directly (see :func:`_load_lmdb_content`);
    the maps are sized for the block's entries up front (a snapshot's keys are distinct)."""
    content, count = blk.content, blk.entry.entry_count
    tables = backend.tables
    kdec: Any = None
    nsdec: Any = None
    no_ns: Any = None
    end = len(content)
    pos = BLOCK_ENTRIES_OFFSET
    head = ENTRY_HEAD.unpack_from
    least, hsize = ENTRY_MIN_BYTES, ENTRY_HEAD.size
    u32 = _U32.unpack_from
    run: list[tuple[Any, Any, Any]] = []
    run_sid = new = -1
    vdec: Any = None
    for i in range(count):
        if end - pos < least:
            break
        sid, klen = head(content, pos)
        kend = pos + hsize + klen
        if end - kend < 8:
            pos += hsize
            break
        (nlen,) = u32(content, kend)
        nend = kend + 4 + nlen
        if end - nend < 4:
            pos = kend + 4
            break
        (vlen,) = u32(content, nend)
        vend = nend + 4 + vlen
        if vend > end:
            pos = nend + 4
            break
        if sid != run_sid:
            if run:
                tables.table(new).map_for(key_group).put_all(run, distinct=True)
                run = []
            got = remap.get(sid)
            if got is None:
                raise _unknown_state(key_group, i, sid)
            run_sid, new = sid, got
            kdec, nsdec, vdec, no_ns = heap_decoders(backend, new)
        run.append((kdec(content[pos + hsize:kend]), nsdec(content[kend + 4:nend]) if nlen else no_ns,
                    vdec(content[nend + 4:vend])))
        pos = vend
    else:
        if pos == end:
            if run:
                tables.table(new).map_for(key_group).put_all(run, distinct=True)
            return count
    raise block_framing_error(blk.key, blk.entry, end, pos)


def _same(data: bytes) -> bytes:
    return data


def heap_decoders(backend: ReplayTarget, state_id: int) -> tuple[Any, Any, Any, Any]:
    """How the heap stores ``state_id``'s entries: the key, namespace and value decoders and
    the namespace an empty one stands for. A raw state (an internal index: the timer service's)
    keeps its bytes as they are (``b""`` stays ``b""``); other states decode with the backend's
    key and namespace codecs (empty: ``None``, the default namespace) and the state's codec."""
    if backend.is_raw_state(state_id):
        return _same, _same, _same, b""
    reg = backend.registered_state(state_id)
    assert reg is not None, state_id  # callers pass ids of the restore's state map only
    return (backend.key_codec.decode, backend.namespace_codec.decode,
            value_decoder(reg.shape), None)


def value_decoder(shape: Any) -> Any:
    """``shape.from_bytes``, or the codec's ``decode`` itself for the kinds whose stored form is
    the codec's (value, reducing, aggregating): one call less per value."""
    return shape.from_bytes if shape.kind in ("list", "map") else shape.codec.decode


def _malformed(key: str, offset: int, kg: int, index: int, cend: int,
               end: int) -> CorruptObjectError:
    """A change that does not fit its block (truncated), or whose key and namespace do not fit
    the change."""
    if cend > end:
        return TruncatedObjectError(key, offset, cend, end, f"change {index} of key group {kg}")
    return CorruptObjectError(key, offset, f"change {index} of key group {kg}: its key or "
                                           "namespace runs past the change")
