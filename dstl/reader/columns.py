"""A split's state as Arrow record batches, column by column: what the Spark source reads.

Theory of operation
-------------------
The row path (:func:`~dstl.reader.state.read_state_split`, then :func:`~dstl.reader.arrow.
batches`) spends microseconds of Python per row: a tuple per entry, a decoded key, namespace
and value, a row object, then one conversion per column value. This module gives the same table
— the columns of :data:`~dstl.reader.arrow.STATE_SCHEMA`, the same rows (in another order where a
log follows a snapshot) — with per-row Python only where a value needs it:

- **Runs.** Entries arrive as :class:`Run`\\ s: entries of one state as Arrow arrays (key group,
  key bytes, namespace bytes, stored value). A v2 snapshot's LMDB file (decompressed into
  memory up to :data:`_IN_MEMORY_BYTES`, else into a staged file) is validated whole and
  located by parsing its pages with numpy (:func:`materializer.lmdb_check.check_data_file`: no
  Python object per entry) and its raw keys (``>HHI`` prefix: key group, state id, key length, read as one
  big-endian word per entry; then key and namespace) are split with numpy, up to a million
  entries a run. Slices of one width (the usual keys and values) are gathered as one item each
  from a view of the file as overlapping ``width``-byte void items: one copy of the key and
  value bytes from the mapped file, which the record batch then shares (``key`` and
  ``key_bytes`` are one data buffer); a v1 block's entries are transposed with ``zip``.
- **Log.** When a log follows the snapshots it is read first, change set by change set
  (:func:`log_columns`: each verified body cut into a payload array with numpy — a block of
  equal-width SETs at its proven stride at once, any other block by its length fields, no bytes
  object per change; the payloads gathered run by run of one length), into an overlay: the changes of
  every (state, key group, key, namespace) it touches, in log order (:meth:`StateImage.changes
  <dstl.reader.image.StateImage.changes>`). Snapshot runs then pass through it: one vectorised
  ``is_in`` on the key bytes finds the candidates; an entry the log touched is taken out and comes
  back with its changes applied to its stored bytes by :meth:`StateImage.apply
  <dstl.reader.image.StateImage.apply>` (the row path's semantics); entries only the log has come
  last. Only touched entries cost Python.
- **Columns.** ``key`` is ``key_bytes`` cast to UTF-8 (decoded per row only in a batch holding a
  key that is not UTF-8); constant columns are ``pa.repeat``; all-empty namespaces are nulls.
  ``value`` of a value, reducing or aggregating state with the safe codec: the pickles
  ``pickle.dumps(int, protocol=5)`` writes — ``BININT1`` (5 bytes), framed ``BININT2``,
  ``BININT`` and ``LONG1`` up to 8 bytes — are matched byte for byte over the whole column with
  numpy (protocol, frame length, opcode, stop; values of one length — small counters, all
  ``BININT1`` — are one matrix of bytes matched column by column against that length's shapes
  only, others are read as little-endian words), decoded as
  little-endian integers and turned into JSON text by one cast (the decimal text ``to_json``
  gives an int). Every other value — other codecs, floats, strings, containers, lists, maps
  (one row per map entry) — goes through the codec and :func:`~dstl.reader.rows.to_json` per row, exactly as in the row path; the tests
  compare the two paths.

Values are decoded with the state's codec in both paths, so a damaged value fails the same way
(:class:`~dstl.errors.CorruptObjectError`). The ``valueType`` column and the ``lmdb`` table use
the row path (:func:`dstl.reader.arrow.batches`).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dstl.checks import check_bool, check_callable, check_instance, check_int
from dstl.envelope import HEADER_SIZE
from dstl.errors import (
    ConfigError,
    CorruptObjectError,
    ObjectNotFoundError,
    TruncatedObjectError,
)
from dstl.handle import ChangelogHandle
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange
from dstl.reader.arrow import STATE_SCHEMA, typed_column
from dstl.reader.catalog import CheckpointCatalog
from dstl.reader.checks import (
    check_cache,
    check_checkpoint_id,
    check_key_bytes,
    check_key_group_count,
    check_keys,
    check_names,
)
from dstl.reader.image import (
    Ident,
    StateImage,
    StateInfo,
    block_snapshot,
    opened_file_snapshot,
    staged_file,
    state_info,
)
from dstl.reader.plan import StateSplit
from dstl.reader.read import plan_state_read
from dstl.reader.rows import to_json
from dstl.reader.state import translate_missing
from dstl.stores.base import BlobStore
from materializer.changes import CLEAR, SET, SET_INTERNAL, decode_metadata
from materializer.codecs import SafeCodec
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.lmdb_check import ValidFile
from materializer.replay import uniform_block
from restore.file_restore import file_snapshot_in_memory, is_file_snapshot, stage_file_snapshot
from restore.leasing import LeasingCache
from restore.reader import ChangelogReader
from restore.restore import plan_restore

__all__ = ["Run", "int_values", "log_columns", "read_state_batches", "read_state_table",
           "run_batches", "snapshot_runs", "state_schema"]

_SAFE = SafeCodec()  # namespaces
_SCALAR_KINDS = frozenset({"value", "reducing", "aggregating"})
_PREFIX = 8  # >HHI: key group, state id, key length
_U32 = struct.Struct(">I")
_BYTE_TEXTS = pa.array([str(i) for i in range(256)], type=pa.string())  # see _int_text
#: Rows per record batch by default (the Spark source asks for 16 k:
#: ``dstl.spark.datasource._BATCH_ROWS``), and entries per chunk of a v2 file listed by cursors.
_CHUNK = 65536
#: Entries of a v2 file per run (the overlay probes the log's keys once per run) and the bytes
#: of its keys or values at most (a binary array's offsets are 32-bit).
_RUN = 1 << 20
_RUN_BYTES = 1 << 30
#: A v2 snapshot's LMDB file of at most this many bytes is decompressed into memory and parsed
#: there (nothing written to the executor's disk; at 1 M entries, 65 MB, zstd takes 0.020 s
#: into memory and 0.033 s into a file); a larger one into a staged file under the executor's
#: local directory, parsed mapped (paged by the kernel).
_IN_MEMORY_BYTES = 256 * 1024 * 1024
#: Runs of one length at most in a change set's payloads gathered run by run (more: at once).
_MAX_RUNS = 16


@dataclass(frozen=True)
class Run:
    """Entries of one state: key groups (int32), key bytes, namespace bytes, stored values."""

    info: StateInfo
    kg: pa.Array
    kb: pa.Array
    nb: pa.Array
    vb: pa.Array

    def __len__(self) -> int:
        return len(self.kb)

    def filter(self, mask: Any) -> Run:
        m = pa.array(mask, type=pa.bool_())
        return Run(self.info, self.kg.filter(m), self.kb.filter(m), self.nb.filter(m),
                   self.vb.filter(m))


# --------------------------------------------------------------------------- buffers


def _buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(offsets as int64, data bytes) of a binary array without nulls (zero copy)."""
    n = len(arr)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32, count=n + 1,
                            offset=arr.offset * 4).astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None and len(bufs[2]) \
        else np.zeros(0, dtype=np.uint8)
    return offsets, data


def _slices(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """A binary array of ``data[starts[i]:starts[i] + lengths[i]]``, gathered by numpy (callers
    check the slices are in bounds)."""
    n = len(starts)
    if n and lengths[0] and data.flags.c_contiguous and (lengths == lengths[0]).all():
        return _equal_slices(data, starts, int(lengths[0]))
    out = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    total = int(out[-1])
    if total:
        idx = np.repeat(starts - out[:-1], lengths) + np.arange(total, dtype=np.int64)
        body = data[idx]
    else:
        body = np.zeros(0, dtype=np.uint8)
    if total > np.iinfo(np.int32).max:
        raise OverflowError(f"{n} slices of {total} bytes do not fit one binary array")
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(out.astype(np.int32)),
                                                  pa.py_buffer(body)])


def _equal_slices(data: np.ndarray, starts: np.ndarray, width: int) -> pa.Array:
    """:func:`_slices` of one width (fixed-width keys and values, the common case): gathered as
    one ``width``-byte item each (:func:`_gather`), not one index per byte."""
    n = len(starts)
    if n * width > np.iinfo(np.int32).max:
        raise OverflowError(f"{n} slices of {width} bytes do not fit one binary array")
    body = _gather(data, starts, width)
    offsets = np.arange(0, n * width + 1, width, dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                  pa.py_buffer(body.reshape(-1))])


def _columns(rows: np.ndarray, first: int, width: int) -> pa.Array:
    """A binary array of ``rows[:, first:first + width]`` (each row of a C-contiguous matrix
    one value of ``width`` bytes), copied into one buffer as one ``width``-byte item per row
    (a strided copy of whole items, a fraction of the cost of a sliced matrix's)."""
    n = len(rows)
    if n * width > np.iinfo(np.int32).max:
        raise OverflowError(f"{n} slices of {width} bytes do not fit one binary array")
    if width:
        body = np.ndarray((n,), dtype=np.dtype((np.void, width)), buffer=rows, offset=first,
                          strides=(rows.shape[1],)).copy().view(np.uint8)
        offsets = np.arange(0, n * width + 1, width, dtype=np.int32)
    else:
        body, offsets = np.zeros(0, dtype=np.uint8), np.zeros(n + 1, dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                  pa.py_buffer(body)])


def _words(data: np.ndarray, dtype: str) -> np.ndarray:
    """``view[i]``: the integer of ``dtype`` (``"<u8"``, ``">u8"``, ``">u2"``) whose bytes start
    at ``data[i]`` (zero copy; a plain ndarray even over a memory map, whose fancy indexing
    costs more)."""
    width = np.dtype(dtype).itemsize
    return np.ndarray((max(len(data) - width + 1, 0),), dtype=dtype, buffer=data, strides=(1,))


def _gather(data: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``(len(starts), width)`` bytes from ``starts`` (callers check they are in bounds):
    ``data`` seen as overlapping ``width``-byte void items, one at every byte, so numpy copies
    each slice as one item (a fraction of the cost of an index per byte)."""
    items = np.ndarray((max(len(data) - width + 1, 0),), dtype=np.dtype((np.void, width)),
                       buffer=data, strides=(1,))
    body: np.ndarray = items[starts].view(np.uint8)
    return body.reshape(len(starts), width)


# --------------------------------------------------------------------------- ints


# protocol 5, FRAME with its u64 little-endian length: the 11 bytes before a framed opcode
def _framed(frame_len: int) -> bytes:
    return b"\x80\x05\x95" + frame_len.to_bytes(8, "little")


#: (total length, the bytes up to the integer's first byte, integer width, signed)
_INT_SHAPES: tuple[tuple[int, bytes, int, bool], ...] = (
    (5, b"\x80\x05\x4b", 1, False),                 # BININT1 (no frame: 3 bytes after PROTO)
    (15, _framed(4) + b"\x4d", 2, False),           # BININT2
    (17, _framed(6) + b"\x4a", 4, True),            # BININT
    *((14 + w, _framed(w + 3) + b"\x8a" + bytes([w]), w, True) for w in range(1, 9)),  # LONG1
)


def int_values(vb: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(ok, values)``: which stored values are an int as ``pickle.dumps(v, protocol=5)``
    writes it (byte for byte: see the module docstring), and those ints (int64; 0 elsewhere).
    Values of one length (small counters: all ``BININT1``) lie back to back, so they are one
    ``(n, length)`` matrix of bytes, matched column by column against that length's shapes
    only (:func:`_matrix_shape`). Otherwise heads and integers are read as little-endian ``u64``
    words at any byte (a copy of the values padded with 16 zero bytes, so no word runs past it)
    and masked to their width, one shape's lengths at a time."""
    offsets, data = _buffers(vb)
    starts, lengths = offsets[:-1], np.diff(offsets)
    n = len(vb)
    ok = np.zeros(n, dtype=bool)
    values = np.zeros(n, dtype=np.int64)
    if n and int(lengths.min()) == int(lengths.max()):
        matrix = data[int(offsets[0]):int(offsets[-1])].reshape(n, int(lengths[0]))
        for shape in _INT_SHAPES:
            if shape[0] == matrix.shape[1]:
                match, raw = _matrix_shape(matrix, shape)
                if match.all():
                    return match, raw
                values[match] = raw[match]
                ok |= match
        return ok, values
    padded = np.zeros(len(data) + 16, dtype=np.uint8)
    padded[:len(data)] = data
    words = _words(padded, "<u8")
    for shape in _INT_SHAPES:
        rows = np.flatnonzero(lengths == shape[0])
        if not len(rows):
            continue
        match, raw = _int_shape(padded, words, starts[rows], shape)
        rows = rows[match]
        values[rows] = raw[match]
        ok[rows] = True
    return ok, values


def _matrix_shape(matrix: np.ndarray, shape: tuple[int, bytes, int, bool]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Which rows of ``matrix`` (values of ``shape``'s total length, one per row) match its
    bytes, and their integers (meaningless where they do not match)."""
    total, head, width, signed = shape
    match = matrix[:, total - 1] == 0x2E  # STOP
    for at, byte in enumerate(head):
        match &= matrix[:, at] == byte
    if width == 1:
        return match, matrix[:, len(head)].astype(np.int64)
    word = np.zeros((len(matrix), 8), dtype=np.uint8)
    word[:, :width] = matrix[:, len(head):len(head) + width]
    return match, _sign_extended(word.view("<i8").reshape(-1), width, signed)


def _int_shape(padded: np.ndarray, words: np.ndarray, s: np.ndarray,
               shape: tuple[int, bytes, int, bool]) -> tuple[np.ndarray, np.ndarray]:
    """Which values starting at ``s`` (each ``shape``'s total length) match its bytes, and
    their integers (meaningless where they do not match). A value of at most 8 bytes
    (``BININT1``) is one word: head, integer and STOP from one gather."""
    total, head, width, signed = shape
    if total <= 8:
        word = words[s]
        fixed = head + bytes(width) + b"\x2e"  # the integer's bytes masked out below
        keep = _mask(total) & ~(_mask(width) << np.uint64(8 * len(head)))
        match = (word & keep) == int.from_bytes(fixed, "little")
        raw = ((word >> np.uint64(8 * len(head))) & _mask(width)).view(np.int64)
    else:
        match = padded[s + total - 1] == 0x2E  # STOP
        for at in range(0, len(head), 8):
            part = head[at:at + 8]
            match &= (words[s + at] & _mask(len(part))) == int.from_bytes(part, "little")
        raw = (words[s + len(head)] & _mask(width)).view(np.int64)
    return match, _sign_extended(raw, width, signed)


def _sign_extended(raw: np.ndarray, width: int, signed: bool) -> np.ndarray:
    """``raw`` (int64 of ``width`` little-endian bytes, zero above) as signed integers of that
    width when ``signed`` (the width's top bit extended)."""
    if signed and width < 8:
        sign = np.int64(1 << (8 * width - 1))
        return (raw ^ sign) - sign
    return raw


def _mask(width: int) -> np.uint64:
    return np.uint64((1 << (8 * width)) - 1)


# --------------------------------------------------------------------------- columns


def _text_keys(kb: pa.Array) -> pa.Array:
    try:
        return kb.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        out = []
        for b in kb.to_pylist():
            try:
                out.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(None)
        return pa.array(out, type=pa.string())


def _namespaces(nb: pa.Array) -> pa.Array:
    offsets, _ = _buffers(nb)
    if offsets[-1] == offsets[0]:  # every namespace empty: the default namespace
        return pa.nulls(len(nb), type=pa.string())
    return pa.array([to_json(_SAFE.decode(b)) if b else None for b in nb.to_pylist()],
                    type=pa.string())


def _values(run: Run) -> pa.Array:
    """The ``value`` column of a run of a non-map state."""
    shape = run.info.shape
    decode = shape.from_bytes
    if run.info.kind not in _SCALAR_KINDS or type(shape.codec) is not SafeCodec:
        return pa.array([to_json(decode(b)) for b in run.vb.to_pylist()], type=pa.string())
    ok, ints = int_values(run.vb)
    text = _int_text(ints)
    if ok.all():
        return text
    if not ok.any():
        return pa.array([to_json(decode(b)) for b in run.vb.to_pylist()], type=pa.string())
    rest: list[str | None] = [None] * len(run)
    others = np.flatnonzero(~ok)
    for i, b in zip(others.tolist(), run.vb.take(pa.array(others)).to_pylist(), strict=True):
        rest[i] = to_json(decode(b))
    return pc.if_else(pa.array(ok), text, pa.array(rest, type=pa.string()))


def _int_text(ints: np.ndarray) -> pa.Array:
    """The JSON text of ``ints``: one cast, or, when every int is under 256 (small counters, the
    ``BININT1`` values), a take from their 256 texts (a third of the cast's cost)."""
    if len(ints) and int(ints.min()) >= 0 and int(ints.max()) < len(_BYTE_TEXTS):
        return _BYTE_TEXTS.take(pa.array(ints))
    return pa.array(ints, type=pa.int64()).cast(pa.string())


def _typed_values(run: Run, kind: pa.DataType) -> pa.Array:
    """``typed_value`` of a run of a non-map state: each value converted to ``kind`` as
    :func:`~dstl.reader.arrow.batches` converts it (:func:`~dstl.reader.arrow.typed_column`, a
    :class:`~dstl.reader.errors.ValueTypeError` for a value that does not convert); safe-codec
    ints that fit an integer ``kind`` in one cast."""
    decode = run.info.shape.from_bytes
    if run.info.kind in _SCALAR_KINDS and type(run.info.shape.codec) is SafeCodec \
            and pa.types.is_integer(kind):
        ok, ints = int_values(run.vb)
        if ok.all() and _fits(ints, kind):
            return pa.array(ints, type=pa.int64()).cast(kind)
    return typed_column([decode(b) for b in run.vb.to_pylist()], kind,
                        lambda i: (run.info.name, _shown_key(run.kb[i].as_py())))


def _fits(ints: np.ndarray, kind: pa.DataType) -> bool:
    """Whether every int64 of ``ints`` is in the range of the integer type ``kind``."""
    if not len(ints):
        return True
    lo, hi = int(ints.min()), int(ints.max())
    bits = int(kind.bit_width)
    if pa.types.is_signed_integer(kind):
        return -(1 << (bits - 1)) <= lo and hi < (1 << (bits - 1))
    return lo >= 0 and hi < (1 << bits)


def _shown_key(kb: bytes) -> str | bytes:
    """A key as the row path's ``key`` column shows it: text when it is UTF-8, else its bytes."""
    try:
        return kb.decode("utf-8")
    except UnicodeDecodeError:
        return kb


def _batch(run: Run, checkpoint: int, partition: str, user_key: pa.Array | None,
           value: Callable[[], pa.Array], schema: pa.Schema,
           typed: Callable[[], pa.Array] | None = None) -> pa.RecordBatch:
    """The run's rows as a batch of ``schema``'s columns (those of :data:`STATE_SCHEMA` it
    names, and the typed value's): only those are built."""
    n = len(run)
    build: dict[str, Callable[[], pa.Array]] = {
        "checkpoint": lambda: pa.repeat(pa.scalar(checkpoint, pa.int64()), n),
        "partition": lambda: pa.repeat(pa.scalar(partition, pa.string()), n),
        "key_group": lambda: run.kg, "key": lambda: _text_keys(run.kb), "key_bytes": lambda: run.kb,
        "state": lambda: pa.repeat(pa.scalar(run.info.name, pa.string()), n),
        "kind": lambda: pa.repeat(pa.scalar(run.info.kind, pa.string()), n),
        "namespace": lambda: _namespaces(run.nb),
        "user_key": lambda: user_key if user_key is not None else pa.nulls(n, type=pa.string()),
        "value": value}
    if typed is not None:
        for name in schema.names:
            build.setdefault(name, typed)  # the one column not of STATE_SCHEMA
    return pa.RecordBatch.from_arrays([build[name]() for name in schema.names], schema=schema)


def _map_batch(run: Run, checkpoint: int, partition: str, schema: pa.Schema,
               typed: pa.DataType | None) -> pa.RecordBatch:
    """One row per map entry (an empty map has none)."""
    at: list[int] = []
    user_keys: list[str | None] = []
    raw: list[Any] = []
    decode = run.info.shape.from_bytes
    for i, b in enumerate(run.vb.to_pylist()):
        for uk, uv in decode(b).items():
            at.append(i)
            user_keys.append(to_json(uk))
            raw.append(uv)
    take = pa.array(at, type=pa.int64())
    rows = Run(run.info, run.kg.take(take), run.kb.take(take), run.nb.take(take),
               run.vb.take(take))
    return _batch(rows, checkpoint, partition, pa.array(user_keys, type=pa.string()),
                  lambda: pa.array([to_json(v) for v in raw], type=pa.string()), schema,
                  lambda: typed_column(raw, typed, lambda i: (run.info.name, _shown_key(
                      run.kb[at[i]].as_py()))))


def state_schema(columns: Sequence[str] | None, typed: tuple[str, pa.DataType] | None = None,
                 owner: str = "state_schema") -> pa.Schema:
    """:data:`STATE_SCHEMA` (with ``typed``'s column after it), or its ``columns`` in that
    order.

    Raises:
        ConfigError: ``columns`` is not a list or tuple of distinct names of its columns.
    """
    full = STATE_SCHEMA if typed is None else STATE_SCHEMA.append(pa.field(*typed))
    if columns is None:
        return full
    names = list(columns) if isinstance(columns, (list, tuple)) else None
    if not names or any(not isinstance(n, str) or n not in full.names
                        or names.count(n) > 1 for n in names):
        raise ConfigError("columns", columns, "None or a list of distinct columns of the state "
                          f"schema ({', '.join(full.names)})", owner=owner)
    return pa.schema([full.field(n) for n in names])


def run_batches(runs: Iterable[Run], checkpoint: int, partition: str,
                keys: Collection[bytes] | None, states: Collection[str] | None,
                schema: pa.Schema = STATE_SCHEMA, batch_rows: int = _CHUNK,
                exclude_states: Callable[[str], bool] | None = None
                ) -> Iterator[pa.RecordBatch]:
    """The state rows of ``runs`` (raw states, states ``exclude_states`` names and filtered-out
    rows left out), as batches of ``schema`` (:func:`state_schema`) of at most ``batch_rows``
    rows."""
    wanted = pa.array(sorted(keys), type=pa.binary()) if keys is not None else None
    extra = [f.type for f in schema if f.name not in STATE_SCHEMA.names]  # typed_value
    typed = extra[0] if extra else None
    for run in runs:
        if run.info.raw or (states is not None and run.info.name not in states) or not len(run):
            continue
        if exclude_states is not None and exclude_states(run.info.name):
            continue
        if wanted is not None:
            run = run.filter(pc.is_in(run.kb, value_set=wanted).to_numpy(zero_copy_only=False))
            if not len(run):
                continue
        if run.info.kind == "map":
            batch = _map_batch(run, checkpoint, partition, schema, typed)
        else:
            batch = _batch(run, checkpoint, partition, None, partial(_values, run), schema,
                           partial(_typed_values, run, typed))
        for first in range(0, batch.num_rows, batch_rows):  # zero-copy slices
            yield batch.slice(first, batch_rows)


# --------------------------------------------------------------------------- sources


def _distinct(sids: np.ndarray) -> list[int]:
    """The distinct state ids of ``sids``, ascending; one state (the common case) without the
    sort or hash of :func:`numpy.unique`."""
    if len(sids) and (sids == sids[0]).all():
        return [int(sids[0])]
    return [int(v) for v in np.unique(sids).tolist()]


def _split_states(states: dict[int, StateInfo], sids: np.ndarray, kg: pa.Array, kb: pa.Array,
                  nb: pa.Array, vb: pa.Array, key: str) -> Iterator[Run]:
    """Runs of one state each from entries of several (a state's entries keep their order)."""
    present = _distinct(sids)
    for sid in present:
        info = states.get(sid)
        if info is None:
            raise CorruptObjectError(key, 0, f"entry of state id {sid}, which the snapshot's "
                                             "metadata does not name")
        if len(present) == 1:
            yield Run(info, kg, kb, nb, vb)
        else:
            m = pa.array(sids == sid)
            yield Run(info, kg.filter(m), kb.filter(m), nb.filter(m), vb.filter(m))


def _check_prefix(lengths: np.ndarray, key: str) -> None:
    if (lengths < _PREFIX).any():
        raise CorruptObjectError(key, 0, "a key of the data file is shorter than its prefix")


def _prefix(head: np.ndarray, lengths: np.ndarray, key: str
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(key groups, state ids, key lengths, namespace lengths)`` of raw keys of ``lengths``
    bytes (each at least the prefix: :func:`_check_prefix`) whose ``>HHI`` prefixes are
    ``head`` (as unsigned integers)."""
    kgs = (head >> np.uint64(48)).astype(np.int32)
    sids = ((head >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.int64)
    klen = (head & np.uint64(0xFFFFFFFF)).astype(np.int64)
    nlen = lengths - _PREFIX - klen
    if (nlen < 0).any():
        raise CorruptObjectError(key, 0, "a key of the data file is shorter than its key "
                                         "length says")
    return kgs, sids, klen, nlen


def _prefixed_runs(states: dict[int, StateInfo], data: np.ndarray, starts: np.ndarray,
                   lengths: np.ndarray, vb: pa.Array, key: str,
                   heads: np.ndarray | None = None) -> Iterator[Run]:
    """Runs of entries whose raw keys (``>HHI`` prefix, key, namespace) are
    ``data[starts[i]:starts[i] + lengths[i]]`` and whose values are ``vb``; ``heads``: their
    first 8 bytes as big-endian words, when known (else read here)."""
    _check_prefix(lengths, key)
    if heads is None:
        heads = _words(data, ">u8")[starts]  # the prefix as one big-endian word
    kgs, sids, klen, nlen = _prefix(heads.astype(np.uint64), lengths, key)
    kb = _slices(data, starts + _PREFIX, klen)
    nb = _slices(data, starts + _PREFIX + klen, nlen)
    yield from _split_states(states, sids, pa.array(kgs), kb, nb, vb, key)


def _fixed_runs(states: dict[int, StateInfo], data: np.ndarray, starts: np.ndarray,
                key_size: int, value_size: int, key: str, heads: np.ndarray, tag: int = 0
                ) -> Iterator[Run] | None:
    """:func:`_prefixed_runs` of entries whose raw keys all have ``key_size`` bytes, each
    followed by its value of ``value_size`` bytes (an LMDB node's value when it is not on
    overflow pages): every entry gathered from the file as one item of both — one pass over the
    file, where gathering keys and values apart takes two, each a cache miss per entry — then
    cut into columns. ``None`` when the key lengths differ (entries of one raw-key
    size with namespaces of several sizes): the caller cuts them entry by entry. ``heads``: the
    raw keys' first 8 bytes as big-endian words (:attr:`EntrySpans.key_head`); ``tag``: bytes
    before each value's own (key layout ``"2"``'s tag 0)."""
    lengths = np.full(len(starts), key_size, dtype=np.int64)
    _check_prefix(lengths, key)
    rows = _gather(data, starts, key_size + value_size)
    kgs, sids, klen, _ = _prefix(heads.astype(np.uint64), lengths, key)
    if not len(klen) or (klen != klen[0]).any():
        return None
    kl = int(klen[0])
    return _split_states(states, sids, pa.array(kgs), _columns(rows, _PREFIX, kl),
                         _columns(rows, _PREFIX + kl, key_size - _PREFIX - kl),
                         _columns(rows, key_size + tag, value_size - tag), key)


def _span_runs(states: dict[int, StateInfo], valid: ValidFile, owned: KeyGroupRange,
               key: str) -> Iterator[Run]:
    """Runs of the entries in ``owned`` of a validated v2 file located by its pages
    (:func:`materializer.lmdb_check.check_data_file`): up to a million entries a piece
    (:func:`_pieces`), so the log overlay probes a file in few calls (:meth:`_Overlay.through`
    builds the log keys' hash set per call), not once per 64 k chunk. The file's keys are in
    key order and each data key has DSTL's prefix (validated), so the entries of ``owned`` are
    one range of the key groups in their first two bytes, cut as views of the spans when it fits
    one piece. Values of key layout ``"2"`` are decoded (:meth:`ValidFile.value`): cut as
    views past the tag byte when a piece holds only tag-0 values."""
    spans = valid.spans
    data, starts = spans.data, spans.key_start
    if not len(starts):
        return
    kgs = (spans.key_head >> np.uint64(48)).astype(np.int64)  # a key's first two bytes
    lo = int(np.searchsorted(kgs, owned.start, side="left"))
    hi = int(np.searchsorted(kgs, owned.end, side="right"))
    pieces: Iterable[Any]
    if hi - lo <= _RUN and int(spans.key_size[lo:hi].sum()) <= _RUN_BYTES \
            and int(spans.value_size[lo:hi].sum()) <= _RUN_BYTES:
        pieces = [slice(lo, hi)] if hi > lo else []  # one piece: views, not copies
    else:
        pieces = _pieces(np.arange(lo, hi), spans.key_size, spans.value_size)
    for sel in pieces:
        at, ksize, vsize = starts[sel], spans.key_size[sel], spans.value_size[sel]
        tag = 0
        if valid.codec is not None:
            if not (data[spans.value_start[sel]] == 0).all():   # (validated: each has a tag)
                vb = pa.array([valid.value(i) for i in np.arange(len(starts))[sel].tolist()],
                              type=pa.binary())
                yield from _prefixed_runs(states, data, at, ksize, vb, key, spans.key_head[sel])
                continue
            tag = 1   # tag 0 only: the stored bytes past the tag are the values
        if len(at) and (ksize == ksize[0]).all() and (vsize == vsize[0]).all() \
                and (spans.value_start[sel] == at + ksize).all():
            runs = _fixed_runs(states, data, at, int(ksize[0]), int(vsize[0]), key,
                               spans.key_head[sel], tag)
            if runs is not None:
                yield from runs
                continue
        yield from _prefixed_runs(states, data, at, ksize,
                                  _slices(data, spans.value_start[sel] + tag, vsize - tag), key,
                                  spans.key_head[sel])


def _pieces(at: np.ndarray, key_size: np.ndarray, value_size: np.ndarray) -> Iterator[np.ndarray]:
    """``at`` cut into pieces of at most :data:`_RUN` entries whose keys and values each stay
    under :data:`_RUN_BYTES` (one binary array's 32-bit offsets); at least one entry each."""
    ends = [np.cumsum(key_size[at]), np.cumsum(value_size[at])]
    first = 0
    while first < len(at):
        last = min(first + _RUN, len(at))
        for cum in ends:
            base = cum[first - 1] if first else 0
            last = min(last, max(first + 1, int(np.searchsorted(cum, base + _RUN_BYTES,
                                                                    side="right"))))
        yield at[first:last]
        first = last


def _file_runs(store: BlobStore, ref: SnapshotRef, wanted: KeyGroupRange, allow_pickle: bool,
               cache: LeasingCache | None) -> Iterator[Run]:
    """A v2 snapshot's entries in ``wanted`` (opened as for :func:`dstl.reader.image.
    stream_snapshots`, through ``cache`` when given), located by parsing the file's pages,
    which validates it whole as a restore does. A file of up to :data:`_IN_MEMORY_BYTES` is
    decompressed into memory and parsed there (:func:`restore.file_restore.
    file_snapshot_in_memory`); a larger one is staged as a restore stages it
    (:func:`restore.file_restore.stage_file_snapshot`) and parsed mapped."""
    with opened_file_snapshot(store, ref, wanted, allow_pickle, cache) as opened, \
            contextlib.ExitStack() as stack:
        if opened is None:
            return
        read, layout, owned, states = opened
        if layout.raw_size <= _IN_MEMORY_BYTES:
            valid = file_snapshot_in_memory(ref, read, layout)
        else:
            parent = os.path.dirname(stack.enter_context(staged_file()))
            valid = stage_file_snapshot(ref, read, layout.size, parent, verified=True).valid
        yield from _span_runs(states, valid, owned, ref.key)


def _block_runs(store: BlobStore, ref: SnapshotRef, wanted: KeyGroupRange, allow_pickle: bool,
                cache: LeasingCache | None) -> Iterator[Run]:
    """A v1 snapshot's entries in ``wanted``, one key-group block at a time."""
    with block_snapshot(store, ref, allow_pickle, cache) as (reader, states):
        for kg, block in reader.read(wanted.intersection(reader.key_groups)):
            entries = list(block)
            if not entries:
                continue
            sids, kbs, nbs, vbs = zip(*entries, strict=True)
            yield from _split_states(states, np.array(sids, dtype=np.int64),
                                     pa.repeat(pa.scalar(kg, pa.int32()), len(entries)),
                                     pa.array(kbs, type=pa.binary()),
                                     pa.array(nbs, type=pa.binary()),
                                     pa.array(vbs, type=pa.binary()), ref.key)


def snapshot_runs(store: BlobStore, refs: Iterable[SnapshotRef], key_groups: KeyGroupRange,
                  allow_pickle: bool, cache: LeasingCache | None = None) -> Iterator[Run]:
    """The entries of the snapshots in ``key_groups`` (each narrowed to its ``ref.key_groups``)
    as runs."""
    for ref in refs:
        wanted = key_groups.intersection(ref.key_groups)
        if not len(wanted):
            continue
        if is_file_snapshot(store.get_range(ref.key, 0, HEADER_SIZE)):
            yield from _file_runs(store, ref, wanted, allow_pickle, cache)
        else:
            yield from _block_runs(store, ref, wanted, allow_pickle, cache)


# --------------------------------------------------------------------------- the log


class _Entries:
    """Entries gathered one by one (those a log changed), as a run."""

    def __init__(self) -> None:
        self.kgs: list[int] = []
        self.kbs: list[bytes] = []
        self.nbs: list[bytes] = []
        self.vbs: list[bytes] = []

    def add(self, ident: Ident, stored: bytes) -> None:
        self.kgs.append(ident[1])
        self.kbs.append(ident[2])
        self.nbs.append(ident[3])
        self.vbs.append(stored)

    def run(self, info: StateInfo) -> Run:
        return Run(info, pa.array(self.kgs, type=pa.int32()), pa.array(self.kbs, type=pa.binary()),
                   pa.array(self.nbs, type=pa.binary()), pa.array(self.vbs, type=pa.binary()))


class _Irregular(Exception):
    """A log the column-wise replay leaves to the per-change one (a state id redefined)."""


def _change_spans(body: bytes, pos: int, end: int, key: str, offset: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the payloads of a block's ``u32 len | payload`` changes in
    ``body[pos:end]``: the framing :func:`dstl.segment.iter_body_changes` walks, with its errors.
    A uniform block (:func:`materializer.replay.uniform_block` proves every change's header
    equal, so the changes sit at one stride) is cut at once; any other is walked change by
    change (one ``unpack`` each, no bytes object per change)."""
    if uniform_block(body, pos, end) is not None:
        stride = 4 + _U32.unpack_from(body, pos)[0]
        starts = np.arange(pos + 4, end, stride, dtype=np.int64)
        return starts, np.full(len(starts), stride - 4, dtype=np.int64)
    starts_l: list[int] = []
    lengths_l: list[int] = []
    unpack = _U32.unpack_from
    while pos < end:
        if end - pos < 4:
            raise TruncatedObjectError(key, offset, pos + 4, end, "change length")
        (n,) = unpack(body, pos)
        pos += 4
        if pos + n > end:
            raise TruncatedObjectError(key, offset, pos + n, end, "change payload")
        starts_l.append(pos)
        lengths_l.append(n)
        pos += n
    return np.array(starts_l, dtype=np.int64), np.array(lengths_l, dtype=np.int64)


def _slices_in_runs(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """:func:`_slices` of a change set's payloads, which come in runs of one length (its
    metadata records; its blocks of equal-width SETs): one gather of whole items per run when
    there are few runs, not one index per byte."""
    edges = np.flatnonzero(lengths[1:] != lengths[:-1]) + 1
    if len(edges) > _MAX_RUNS:
        return _slices(data, starts, lengths)
    bounds = [0, *edges.tolist(), len(lengths)]
    parts = [_slices(data, starts[a:b], lengths[a:b]) for a, b in pairwise(bounds)]
    return parts[0] if len(parts) == 1 else pa.concat_arrays(parts)


def log_columns(reader: ChangelogReader, handle: ChangelogHandle,
                key_groups: Container[int] | None
                ) -> tuple[np.ndarray, pa.Array]:
    """``(key groups, payloads)`` of every change of ``handle`` in ``key_groups`` (metadata
    included), in the order :meth:`ChangelogReader.read <restore.reader.ChangelogReader.read>`
    yields them — change sets in sqn order, blocks by key group, changes in append order — with
    the same checks (:meth:`~restore.reader.ChangelogReader.read_blocks` verifies the records and
    the blocks, :func:`_change_spans` the changes' framing); one payload array per change set,
    cut with numpy from its body."""
    kgs: list[np.ndarray] = []
    arrays: list[pa.Array] = []
    for ref, body, blocks in reader.read_blocks(handle, key_groups=key_groups):
        spans = [(kg, *_change_spans(body, pos, end, ref.key, ref.offset))
                 for kg, pos, end in blocks]
        spans = [s for s in spans if len(s[1])]
        if not spans:
            continue
        starts = np.concatenate([s[1] for s in spans])
        lengths = np.concatenate([s[2] for s in spans])
        kgs.append(np.concatenate([np.full(len(s[1]), s[0], dtype=np.int64) for s in spans]))
        arrays.append(_slices_in_runs(np.frombuffer(body, dtype=np.uint8), starts, lengths))
    if not arrays:
        return np.zeros(0, dtype=np.int64), pa.array([], type=pa.binary())
    return np.concatenate(kgs), pa.concat_arrays(arrays) if len(arrays) > 1 else arrays[0]


def _parse_changes(payloads: pa.Array) -> tuple[np.ndarray, np.ndarray, pa.Array, pa.Array,
                                                 pa.Array]:
    """``(op, state id, key, namespace, op payload)`` columns of data records (the layout
    :func:`materializer.changes.decode_change` reads), split with numpy; the same checks."""
    offsets, data = _buffers(payloads)
    starts, lengths = offsets[:-1], np.diff(offsets)
    if (lengths < 7).any():
        raise CorruptObjectError("<change>", 0, "malformed change record: shorter than its "
                                                "op, state id and key length")
    head = _gather(data, starts, 7).astype(np.int64)
    klen = (head[:, 3] << 24) | (head[:, 4] << 16) | (head[:, 5] << 8) | head[:, 6]
    if (7 + klen + 4 > lengths).any():
        raise CorruptObjectError("<change>", 0, "malformed change record: the key runs past "
                                                "the record")
    nl = _gather(data, starts + 7 + klen, 4).astype(np.int64)
    nlen = (nl[:, 0] << 24) | (nl[:, 1] << 16) | (nl[:, 2] << 8) | nl[:, 3]
    ns_end = 7 + klen + 4 + nlen
    if (ns_end > lengths).any():
        raise CorruptObjectError("<change>", 0, "namespace runs past the record")
    return (head[:, 0], (head[:, 1] << 8) | head[:, 2], _slices(data, starts + 7, klen),
            _slices(data, starts + 11 + klen, nlen), _slices(data, starts + ns_end,
                                                                lengths - ns_end))


def _check_scalar_ops(info: StateInfo, ops: np.ndarray) -> None:
    bad = ops[~np.isin(ops, (CLEAR, SET, SET_INTERNAL))]
    if len(bad):  # what StateImage.apply refuses
        raise CorruptObjectError("<changelog>", 0, f"op code {int(bad[0])} on {info.kind} state "
                                                   f"{info.name!r}")


@dataclass(frozen=True)
class _LastIndex:
    """The key bytes of a value-like state's last changes (what a snapshot run is probed
    with), and their key groups (``kg``) when each key bytes occurs once and every namespace
    is the default one: then key bytes and key group name the entry."""

    keys: pa.Array
    kg: np.ndarray | None

    @classmethod
    def of(cls, last: pa.Table, unique: bool | None = None) -> _LastIndex:
        """``unique``: whether each key bytes occurs once in ``last`` (``None``: count)."""
        keys = last["kb"].combine_chunks()
        offsets, _ = _buffers(last["nb"].combine_chunks())
        simple = offsets[-1] == offsets[0] and (
            unique if unique is not None else pc.count_distinct(keys).as_py() == len(keys))
        return cls(keys, last["kg"].combine_chunks().to_numpy() if simple else None)


class _Overlay:
    """The changes a log holds, applied to the snapshot runs passing through.

    Value, reducing and aggregating states (whose changes are SET and CLEAR only) are replayed
    column-wise: a log's records are split with numpy, and the last change of every entry wins
    (one group-by); a snapshot run drops the entries they name (:meth:`_without_changed`)
    and the surviving SETs come last. List and map changes depend on the entry before them:
    they are kept per entry in log order and applied by :meth:`StateImage.apply` to the stored
    bytes of the entries they touch. A log that redefines a state id is replayed change by
    change."""

    def __init__(self, allow_pickle: bool) -> None:
        self.image = StateImage(allow_pickle)  # states, and the semantics of a change
        self.changes: dict[Ident, list[tuple[StateInfo, int, bytes]]] = {}
        self.keys: dict[str, set[bytes]] = {}
        self._wanted: dict[str, pa.Array] = {}
        self._index: dict[str, _LastIndex] = {}  # per value-like state: its last changes' keys
        self._scalar: dict[str, list[pa.RecordBatch]] = {}  # per state: its changes in order
        self._last: dict[str, pa.Table] | None = None

    def replay(self, reader: ChangelogReader, handle: ChangelogHandle,
               key_groups: Container[int] | None) -> None:
        kgs, payloads = log_columns(reader, handle, key_groups)
        if not len(kgs):
            return
        try:
            self._replay_columns(kgs, payloads, handle.log_id)
        except _Irregular:
            records = list(zip(kgs.tolist(), payloads.to_pylist(), strict=True))
            self._replay_rows(records, handle.log_id)

    def _metadata(self, kgs: np.ndarray, payloads: pa.Array, log_id: str
                  ) -> tuple[dict[int, StateInfo], dict[int, int]]:
        """The log's states by id, and where each id's metadata record is."""
        names: dict[int, StateInfo] = {}
        first: dict[int, int] = {}
        for pos in np.flatnonzero(kgs == META_KEY_GROUP).tolist():
            sid, meta = decode_metadata(payloads[pos].as_py())
            info = self.image.known(state_info(meta, self.image.allow_pickle, log_id),
                                    f"the log of {log_id}")
            if names.setdefault(sid, info) is not info:  # redefined: change by change
                raise _Irregular
            first.setdefault(sid, pos)
        return names, first

    def _replay_columns(self, kgs: np.ndarray, payloads: pa.Array, log_id: str) -> None:
        names, first = self._metadata(kgs, payloads, log_id)
        at = np.flatnonzero(kgs != META_KEY_GROUP)
        if not len(at):
            return
        ops, sids, kb, nb, pl = _parse_changes(payloads if len(at) == len(kgs)
                                               else payloads.take(pa.array(at)))
        kg = pa.array(kgs[at].astype(np.int32))
        for sid in _distinct(sids):
            rows = np.flatnonzero(sids == sid)
            info = names.get(sid)
            if info is None or at[rows[0]] < first[sid]:
                raise CorruptObjectError(f"<changelog of {log_id}>", 0, f"change for state id "
                                         f"{sid} before its metadata record")
            take = pa.array(rows)
            cols = (kg.take(take), kb.take(take), nb.take(take), ops[rows], pl.take(take))
            self._add(info, *cols)

    def _replay_rows(self, records: list[tuple[int, bytes]], log_id: str) -> None:
        scalar: dict[str, tuple[StateInfo, _Entries, list[int]]] = {}
        for ident, info, op, payload in self.image.decode(records, log_id):
            if info.kind in _SCALAR_KINDS:
                entries, ops = scalar.setdefault(info.name, (info, _Entries(), []))[1:]
                entries.add(ident, payload)
                ops.append(op)
            else:
                self.changes.setdefault(ident, []).append((info, op, payload))
                self.keys.setdefault(ident[0], set()).add(ident[2])
        for info, entries, ops in scalar.values():
            run = entries.run(info)
            self._add(info, run.kg, run.kb, run.nb, np.array(ops, dtype=np.int64), run.vb)

    def _add(self, info: StateInfo, kg: pa.Array, kb: pa.Array, nb: pa.Array, ops: np.ndarray,
             payload: pa.Array) -> None:
        """Changes of one state, in log order (after those added before)."""
        if info.kind in _SCALAR_KINDS:
            _check_scalar_ops(info, ops)
            self._scalar.setdefault(info.name, []).append(pa.RecordBatch.from_arrays(
                [kg, kb, nb, pa.array(ops, type=pa.int64()), payload],
                names=["kg", "kb", "nb", "op", "vb"]))
            return
        changes, touched = self.changes, self.keys.setdefault(info.name, set())
        for k, key, ns, op, p in zip(kg.to_pylist(), kb.to_pylist(), nb.to_pylist(),
                                     ops.tolist(), payload.to_pylist(), strict=True):
            changes.setdefault((info.name, k, key, ns), []).append((info, op, p))
            touched.add(key)

    def _last_changes(self) -> dict[str, pa.Table]:
        """Per value-like state, the last change of every entry it changed: every change, in
        log order, when each key bytes was changed once (a log of new keys; a counter's log
        that touched each key once), else one group-by."""
        if self._last is None:
            self._last = {}
            for name, batches in self._scalar.items():
                t = pa.Table.from_batches(batches).combine_chunks()
                if pc.count_distinct(t["kb"]).as_py() == len(t):
                    self._last[name] = t
                    self._index[name] = _LastIndex.of(t, unique=True)
                    continue
                t = t.append_column("row", pa.array(np.arange(len(t), dtype=np.int64)))
                last = t.group_by(["kg", "kb", "nb"], use_threads=False).aggregate(
                    [("row", "max")])
                self._last[name] = t.take(last["row_max"]).drop_columns(["row"])
        return self._last

    def _resolve(self, ident: Ident, base: bytes | None) -> bytes | None:
        entries = self.image.entries
        entries.clear()
        if base is not None:
            entries[ident] = base
        for info, op, payload in self.changes.pop(ident):
            self.image.apply(ident, info, op, payload)
        return entries.pop(ident, None)

    def through(self, run: Run) -> Iterator[Run]:
        """``run`` with the entries the log changed replaced by their new state."""
        name = self.image.known(run.info, "a snapshot").name
        last = self._last_changes().get(name)
        if last is not None:
            run = self._without_changed(name, last, run)
        touched = self.keys.get(name)
        if not touched:
            yield run
            return
        yield from self._through_entries(run, name, touched)

    def _without_changed(self, name: str, last: pa.Table, run: Run) -> Run:
        """``run`` without the entries of a value-like state that the log changed (they come
        back from :meth:`rest`). One hash lookup per entry finds those whose key bytes the log
        names (none, for a log of new keys: the run as it is); only they are matched exactly
        on key group, key and namespace: by comparing with the log's entry of the same key
        bytes when the log changed each key bytes once, in the default namespace (a counter's
        log), else with an anti-join. The run keeps its order."""
        index = self._index.get(name)
        if index is None:
            index = self._index[name] = _LastIndex.of(last)
        pos = pc.index_in(run.kb, value_set=index.keys)
        hit = pos.is_valid().to_numpy(zero_copy_only=False)
        at = np.flatnonzero(hit)
        if not len(at):
            return run
        keep = ~hit
        if index.kg is not None:
            offsets, _ = _buffers(run.nb)
            same = (run.kg.to_numpy()[at] == index.kg[pos.drop_null().to_numpy()]) \
                & (offsets[at + 1] == offsets[at])
            keep[at[~same]] = True
        else:
            take = pa.array(at)
            candidates = pa.table({"kg": run.kg.take(take), "kb": run.kb.take(take),
                                   "nb": run.nb.take(take), "at": take})
            unchanged = candidates.join(last.select(["kg", "kb", "nb"]),
                                        keys=["kg", "kb", "nb"], join_type="left anti",
                                        use_threads=False)
            keep[unchanged["at"].to_numpy()] = True
        return run.filter(keep)

    def _through_entries(self, run: Run, name: str, touched: set[bytes]) -> Iterator[Run]:
        """List and map entries: those the log touched, with its changes applied."""
        wanted = self._wanted.get(name)
        if wanted is None:
            wanted = self._wanted[name] = pa.array(sorted(touched), type=pa.binary())
        hits = np.flatnonzero(pc.is_in(run.kb, value_set=wanted).to_numpy(zero_copy_only=False))
        keep = np.ones(len(run), dtype=bool)
        out = _Entries()
        for i in hits.tolist():
            ident = (name, run.kg[i].as_py(), run.kb[i].as_py(), run.nb[i].as_py())
            if ident not in self.changes:
                continue
            keep[i] = False
            new = self._resolve(ident, run.vb[i].as_py())
            if new is not None:
                out.add(ident, new)
        yield run.filter(keep) if not keep.all() else run
        if out.kgs:
            yield out.run(run.info)

    def rest(self) -> Iterator[Run]:
        """The entries the log set (value-like states) or only the log has (lists, maps)."""
        for name, last in self._last_changes().items():
            sets = last.filter(pc.not_equal(last["op"], CLEAR))
            if sets.num_rows:
                yield Run(self.image.states[name], *(sets[c].combine_chunks()
                                                     for c in ("kg", "kb", "nb", "vb")))
        by_state: dict[str, _Entries] = {}
        for ident in list(self.changes):
            new = self._resolve(ident, None)
            if new is not None:
                by_state.setdefault(ident[0], _Entries()).add(ident, new)
        for name, entries in by_state.items():
            yield entries.run(self.image.states[name])


# --------------------------------------------------------------------------- a split


def _split_runs(store: BlobStore, split: StateSplit, handle: ChangelogStateBackendHandle,
                cache: LeasingCache | None, allow_pickle: bool) -> Iterator[Run]:
    rng = split.key_group_range
    plan = plan_restore([handle], rng)  # narrowed to what the handle owns in the range
    logs = [h for h in plan.logs if h.change_sets]
    if any(r.delta for r in plan.snapshots):
        yield from _chain_runs(store, plan.snapshots, logs, rng, cache, allow_pickle,
                               plan.max_parallelism)
        return
    runs = snapshot_runs(store, plan.snapshots, rng, allow_pickle, cache)
    if not logs:
        yield from runs
        return
    overlay = _Overlay(allow_pickle)
    reader = ChangelogReader(store, cache=cache)
    for h in logs:
        overlay.replay(reader, h, rng.intersection(h.replay_key_groups))
    for run in runs:
        yield from overlay.through(run)
    yield from overlay.rest()


def _chain_runs(store: BlobStore, refs: Sequence[SnapshotRef], logs: Sequence[ChangelogHandle],
                rng: KeyGroupRange, cache: LeasingCache | None, allow_pickle: bool,
                max_parallelism: int) -> Iterator[Run]:
    """The split's entries when its snapshots are a chain with deltas: a delta changes entries
    a snapshot run would already have yielded, so the chain is loaded as the row reader loads
    it (:meth:`StateImage.load <dstl.reader.image.StateImage.load>`: each piece in order,
    checked as a restore checks it), the log replayed over it, and the entries come out as one
    run per state. The split's state is held in memory (as the row reader holds it)."""
    image = StateImage(allow_pickle)
    image.load(store, refs, rng, cache, max_parallelism=max_parallelism)
    if logs:
        reader = ChangelogReader(store, cache=cache)
        for h in logs:
            image.replay(reader, h, rng.intersection(h.replay_key_groups))
    by_state: dict[str, _Entries] = {}
    for info, kg, kb, nb, vb in image.rows():
        by_state.setdefault(info.name, _Entries()).add((info.name, kg, kb, nb), vb)
    for name, entries in by_state.items():
        yield entries.run(image.states[name])


def read_state_batches(store: BlobStore, split: StateSplit, *,
                       cache: LeasingCache | None = None, allow_pickle: bool = False,
                       keys: Collection[bytes] | None = None,
                       states: Collection[str] | None = None,
                       columns: Sequence[str] | None = None,
                       typed: tuple[str, pa.DataType] | None = None,
                       batch_rows: int = _CHUNK,
                       exclude_states: Callable[[str], bool] | None = None
                       ) -> Iterator[pa.RecordBatch]:
    """The state rows of one split as record batches of :data:`~dstl.reader.arrow.STATE_SCHEMA`
    — the rows :func:`~dstl.reader.state.read_state_split` gives (heap table), in
    :func:`~dstl.reader.arrow.batches`' columns, built column-wise (see the module docstring).
    With ``columns``, the batches have only those columns, in that order, and only they are
    built (a read of ``key`` and ``value`` decodes no namespace and copies no key bytes).
    ``typed`` (``(name, Arrow type)``) adds a column of the values converted to that type, as
    :func:`~dstl.reader.arrow.batches` adds it (after the others, or where ``columns`` names
    it). Batches have at most ``batch_rows`` rows (zero-copy slices of larger ones).
    ``exclude_states`` (a state name -> whether to leave its rows out) is asked once per run of
    one state's entries, not per row (the Spark sources leave DSTL's own states out so).

    Raises:
        CheckpointDeletedError, ObjectNotFoundError, CorruptObjectError, UsageError: as
        :func:`~dstl.reader.state.read_state_split`.
        ConfigError: an argument of the wrong type or out of range (raised by the call).
    """
    owner = "read_state_batches"
    check_instance(split, "split", owner, StateSplit)
    check_bool(allow_pickle, "allow_pickle", owner)
    check_cache(cache, owner)
    keys = check_key_bytes(keys, owner)
    states = check_names(states, "states", owner)
    if typed is not None and not (
            isinstance(typed, tuple) and len(typed) == 2 and isinstance(typed[0], str)
            and isinstance(typed[1], pa.DataType) and typed[0] not in STATE_SCHEMA.names):
        raise ConfigError("typed", typed, "None or (a column name not in the state schema, a "
                          "pyarrow.DataType)", owner=owner)
    schema = state_schema(columns, typed, owner)
    check_int(batch_rows, "batch_rows", owner, lo=1)
    if exclude_states is not None:
        check_callable(exclude_states, "exclude_states", owner, args=1)
    handle = ChangelogStateBackendHandle.from_json(split.handle)

    def batches() -> Iterator[pa.RecordBatch]:
        try:
            yield from run_batches(_split_runs(store, split, handle, cache, allow_pickle),
                                   split.checkpoint_id, split.task_id, keys, states, schema,
                                   batch_rows, exclude_states)
        except ObjectNotFoundError as exc:
            raise translate_missing(store, split.checkpoint_id, exc) from exc

    return batches()


def read_state_table(catalog: CheckpointCatalog, checkpoint_id: int | None = None, *,
                     keys: Collection[str | bytes] | None = None,
                     states: Collection[str] | None = None, cache: LeasingCache | None = None,
                     allow_pickle: bool = False, max_key_groups: int | None = None
                     ) -> Iterator[pa.RecordBatch]:
    """Every state row of a checkpoint (``None``: the newest) as record batches of
    :data:`~dstl.reader.arrow.STATE_SCHEMA`, split by split: the rows
    :func:`~dstl.reader.read.read_state` gives (heap table), built column-wise
    (``dstl state dump --format parquet``).

    Raises:
        ConfigError: an argument of the wrong type or out of range (raised by the call, before
            anything is read).
        CheckpointNotFoundError, CheckpointDeletedError, CorruptObjectError, UsageError: as
            :func:`~dstl.reader.read.read_state` (as the result is iterated).
    """
    owner = "read_state_table"
    check_instance(catalog, "catalog", owner, CheckpointCatalog)
    check_checkpoint_id(checkpoint_id, "checkpoint_id", owner)
    check_keys(keys, owner)
    states = check_names(states, "states", owner)
    check_bool(allow_pickle, "allow_pickle", owner)
    check_key_group_count(max_key_groups, "max_key_groups", owner)
    check_cache(cache, owner)

    def table() -> Iterator[pa.RecordBatch]:
        splits, wanted = plan_state_read(catalog, checkpoint_id, keys, max_key_groups)
        for split in splits:
            yield from read_state_batches(catalog.store, split, cache=cache,
                                          allow_pickle=allow_pickle, keys=wanted, states=states)

    return table()

