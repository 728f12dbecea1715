"""The table marker: what an on-disk state table reflects, stored in the table itself.

Theory of operation
-------------------
A process other than the table's writer (under Spark: the executor agent) may materialize an LMDB
table while workers keep writing it. A read transaction is a consistent view of the table, but
the reader must also know *which log* that view reflects, or it cannot say where the log after the
snapshot begins. So every checkpoint that a backend writes into an on-disk table also writes this
marker into the same LMDB transaction as the state changes it describes (the task commits its
write batch only after the checkpoint's log is durable): a read transaction sees either the old
state with the old marker, or the new state with the new one, never a mix.

The marker names the table's log position by its **boundary**: the ``(segment key, offset)`` of
the last change set of the checkpoint's log. Segment records are written once under names unique
per upload, so a boundary is unique in the whole store: a snapshot taken at boundary ``B`` can be
installed by any backend whose own log (restored handles + its writer's change sets) contains
``B`` — that proves its lineage went through exactly the state the snapshot holds — and the log
after ``B`` is what remains to replay. A backend whose log does not contain ``B`` (the batch was
re-run, the partition was restored elsewhere, a newer snapshot is installed already) simply does
not install it. ``boundary=None``: the table is exactly its materialized snapshot(s); there is
nothing new to materialize.

The marker also carries the state registry (state id -> name, kind, codecs), so a snapshot taken
from outside the writer is self-describing, and the sizes the size trigger needs. Two fields serve
incremental materialization from outside the writer (:mod:`dstl.spark.agent.materializer`): the
checkpoint's snapshot pieces (``snapshots``: key and materialization id of each, in order), so the
agent knows which chain a delta may follow, and the table's ``table_id``, a random name the table
gets whenever it is created or restored and keeps while backends adopt it: equal ids at two read
transactions prove that every change between them was logged by a writer of this table (nothing was
loaded into it from a snapshot in between). Decoding is
strict: the table directory is local, but the marker decides what a snapshot claims to be. It is
bounded (:data:`MAX_MARKER_BYTES` before parsing, nesting after:
:func:`dstl.untrusted.load_json`), every integer has a range, every state description passes
:func:`materializer.changes.check_state_meta`, and every failure is a
:class:`~dstl.errors.CorruptObjectError` naming the marker (``where``) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dstl.errors import CorruptObjectError, UsageError
from dstl.handle import ChangelogHandle
from dstl.keygroups import MAX_PARALLELISM_LIMIT, KeyGroupRange
from dstl.stores.base import check_key
from dstl.untrusted import load_json
from materializer.changes import MAX_STATES_METADATA_BYTES, check_state_meta
from materializer.handles import ChangelogStateBackendHandle

__all__ = ["MARKER_VERSION", "MAX_MARKER_BYTES", "TableMarker", "boundary_of"]

MARKER_VERSION = 1
#: Largest marker accepted (checked before parsing): the state registry plus a few fields.
MAX_MARKER_BYTES = MAX_STATES_METADATA_BYTES + 64 * 1024
_MAX_INT = (1 << 63) - 1


def boundary_of(non_materialized: Iterable[ChangelogHandle]) -> tuple[str, int] | None:
    """``(segment key, offset)`` of the last change set of a checkpoint's log, or ``None``."""
    last = next((h.change_sets[-1] for h in reversed(tuple(non_materialized))
                 if h.change_sets), None)
    return (last.key, last.offset) if last is not None else None


def _int(obj: dict[str, Any], name: str, where: str, minimum: int = 0,
         maximum: int = _MAX_INT) -> int:
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not minimum <= v <= maximum:
        raise CorruptObjectError(where, 0, f"table marker field {name}={v!r:.80} is not an int "
                                           f"in [{minimum}, {maximum}]")
    return v


def _boundary(b: Any, where: str) -> tuple[str, int] | None:
    if b is None:
        return None
    if (not isinstance(b, list) or len(b) != 2 or not isinstance(b[0], str)
            or not isinstance(b[1], int) or isinstance(b[1], bool) or not 0 <= b[1] <= _MAX_INT):
        raise CorruptObjectError(where, 0, f"table marker boundary={b!r:.120} is not "
                                           "[segment key, offset]")
    try:
        return check_key(b[0]), b[1]
    except UsageError as exc:
        raise CorruptObjectError(where, 0, f"table marker boundary: {exc}") from exc


def _states(states: Any, where: str) -> dict[str, dict[str, Any]]:
    if not isinstance(states, dict):
        raise CorruptObjectError(where, 0, "table marker states are not {id: metadata}")
    for sid, meta in states.items():
        if not (sid.isascii() and sid.isdigit() and len(sid) <= 5 and int(sid) <= 0xFFFF):
            raise CorruptObjectError(where, 0, f"table marker state id {sid!r:.40} is not an "
                                               "integer in [0, 65535]")
        check_state_meta(meta, key=where, offset=0, what=f"table marker state {sid}")
    return states


@dataclass(frozen=True, slots=True)
class TableMarker:
    """What an on-disk table holds (see the module docstring).

    Attributes:
        operator_id: the backend (log id) that wrote the table.
        key_groups: its key-group range.
        max_parallelism: the job's number of key groups.
        checkpoint_id: the checkpoint whose state the table holds.
        materialization_id: the newest materialization in that checkpoint (0: none).
        boundary: ``(segment key, offset)`` of the last change set of the checkpoint's log, or
            ``None`` when the checkpoint has no log after its snapshots.
        log_bytes: stored bytes of that log (the size trigger compares it with the snapshot).
        snapshot_bytes: stored bytes of the checkpoint's snapshot objects.
        states: state id (as a string) -> state metadata (name, kind, codecs).
        snapshots: ``(object key, materialization id)`` of each snapshot piece of the
            checkpoint, in order (a full snapshot, then its deltas).
        table_id: the table's incarnation (see the module docstring; ``""``: not recorded).
    """

    operator_id: str
    key_groups: KeyGroupRange
    max_parallelism: int
    checkpoint_id: int
    materialization_id: int
    boundary: tuple[str, int] | None
    log_bytes: int = 0
    snapshot_bytes: int = 0
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    snapshots: tuple[tuple[str, int], ...] = ()
    table_id: str = ""

    def holds(self, handle: ChangelogStateBackendHandle) -> bool:
        """Whether the table holds exactly the checkpoint of ``handle``: the same checkpoint, the
        same last change set and the same snapshot pieces. A batch id alone cannot tell two
        attempts of one batch apart (a re-run, or Spark's speculative second attempt); their
        change sets can, and when an attempt materialized all of its log (no change set after
        its snapshot), its snapshot pieces can (their names are unique per upload)."""
        return (self.checkpoint_id == handle.checkpoint_id
                and self.boundary == boundary_of(handle.non_materialized)
                and tuple(key for key, _ in self.snapshots)
                == tuple(p.key for p in handle.materialized))

    def to_bytes(self) -> bytes:
        return json.dumps({
            "v": MARKER_VERSION, "operator_id": self.operator_id,
            "key_groups": self.key_groups.to_json_obj(), "max_parallelism": self.max_parallelism,
            "checkpoint_id": self.checkpoint_id, "materialization_id": self.materialization_id,
            "boundary": list(self.boundary) if self.boundary is not None else None,
            "log_bytes": self.log_bytes, "snapshot_bytes": self.snapshot_bytes,
            "states": self.states, "snapshots": [list(p) for p in self.snapshots],
            "table_id": self.table_id,
        }, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "<table marker>") -> TableMarker:
        """Decode a marker.

        Raises:
            CorruptObjectError: not a marker of a version this code reads (names ``where``).
        """
        obj = load_json(data, key=where, what="table marker", max_bytes=MAX_MARKER_BYTES)
        version = obj.get("v") if isinstance(obj, dict) else None
        if version != MARKER_VERSION or isinstance(version, bool):
            raise CorruptObjectError(where, 0, f"table marker version {version!r:.40} is not "
                                               f"{MARKER_VERSION} (written by another DSTL "
                                               "version?)")
        op = obj.get("operator_id")
        if not isinstance(op, str) or not op:
            raise CorruptObjectError(where, 0, f"table marker operator_id={op!r:.80}")
        try:
            kgs = KeyGroupRange.from_json_obj(obj.get("key_groups"))
        except UsageError as exc:
            raise CorruptObjectError(where, 0, f"table marker: {exc}") from exc
        return cls(op, kgs, _int(obj, "max_parallelism", where, 1, MAX_PARALLELISM_LIMIT),
                   _int(obj, "checkpoint_id", where, -1), _int(obj, "materialization_id", where),
                   _boundary(obj.get("boundary"), where), _int(obj, "log_bytes", where),
                   _int(obj, "snapshot_bytes", where), _states(obj.get("states"), where),
                   _pieces(obj.get("snapshots", []), where), _table_id(obj.get("table_id", ""),
                                                                       where))


#: Most snapshot pieces a marker lists (a full snapshot and at most 1000 deltas per range, for a
#: few ranges after rescaling).
_MAX_PIECES = 4096


def _pieces(raw: Any, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, list) or len(raw) > _MAX_PIECES:
        raise CorruptObjectError(where, 0, f"table marker snapshots={raw!r:.80} is not a list of "
                                           f"at most {_MAX_PIECES} [object key, id] pairs")
    out: list[tuple[str, int]] = []
    for p in raw:
        if (not isinstance(p, list) or len(p) != 2 or not isinstance(p[0], str)
                or not isinstance(p[1], int) or isinstance(p[1], bool)
                or not 0 <= p[1] <= _MAX_INT):
            raise CorruptObjectError(where, 0, f"table marker snapshot piece {p!r:.120} is not "
                                               "[object key, materialization id]")
        try:
            out.append((check_key(p[0]), p[1]))
        except UsageError as exc:
            raise CorruptObjectError(where, 0, f"table marker snapshot piece: {exc}") from exc
    return tuple(out)


def _table_id(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or len(raw) > 64 or not raw.isascii() or not (
            raw == "" or raw.isalnum()):
        raise CorruptObjectError(where, 0, f"table marker table_id={raw!r:.80} is not up to 64 "
                                           "ASCII letters and digits")
    return raw
