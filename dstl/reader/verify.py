"""``verify``: does a checkpoint hold — every object it needs exists, and every byte checks out.

Theory of operation
-------------------
Restore-and-compare validation without the restore: the manifest is decoded strictly (its CRC
and canonical form), each task's state is parsed as a backend handle, and then every object the
handles name is fetched whole and verified by its own decoder — a segment with
:func:`~dstl.segment.decode_segment` (object CRC, every record's CRC and zstd checksum), a
snapshot with :func:`~materializer.snapshot_format.decode_snapshot` (object CRC, index, every
block), a delta (format v3) with :func:`~materializer.delta_format.decode_delta` (every
entry's framing, order, state and key group too), a v2 (file-level) snapshot as a restore stages
it
(:func:`~restore.file_restore.validate_file_snapshot`: object crc, zstd checksum and size, the
LMDB file validated whole), so ``verify`` fails exactly where a restore would on the stored bytes.
On top of the checksums, the references must agree with the objects: every change set a
handle names is a record of its segment with the same offset, length, writer and sqn; every
snapshot has the size the handle recorded and covers the key groups it claims; and every object
a handle needs is in the task's ``referenced_keys`` (what retention keeps — an object missing
there could be deleted under the checkpoint).

Problems are collected, not raised one at a time: a report names every missing or damaged
object (with the typed error that describes it), so one run tells the whole story. Objects are
verified in key order, and ``progress(done, total, bytes)`` is called after each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dstl.checkpoint.manifest import Manifest
from dstl.checks import check_callable, check_instance
from dstl.envelope import HEADER_SIZE
from dstl.errors import DECODER_BUGS, CorruptObjectError, DstlError, ObjectNotFoundError, placed
from dstl.handle import ChangeSetRef
from dstl.keygroups import KeyGroupRange
from dstl.reader.catalog import CheckpointCatalog, task_states
from dstl.reader.checks import check_checkpoint_id
from dstl.reader.image import state_info
from dstl.segment import decode_segment
from materializer.codecs import SafeCodec
from materializer.delta_format import DELTA_VERSION, DeltaReader, decode_delta
from materializer.file_snapshot import snapshot_version
from materializer.handles import SnapshotRef
from materializer.lmdb_table import KEY_PREFIX
from materializer.snapshot_format import decode_snapshot
from materializer.state_tables import BytesSource
from restore.file_restore import StagedSnapshot, is_file_snapshot, validate_file_snapshot
from restore.restore import check_delta_piece

__all__ = ["Progress", "VerifyProblem", "VerifyReport", "verify_checkpoint"]

#: A backend's namespace codec (the safe one), for decoding namespaces as a restore does.
_NAMESPACES = SafeCodec()

#: ``progress(objects done, objects total, bytes read so far)``.
Progress = Callable[[int, int, int], None]


@dataclass(frozen=True, slots=True)
class VerifyProblem:
    """One thing wrong: the object (or manifest) and the typed error that says what."""

    key: str
    error: DstlError


@dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` found."""

    checkpoint_id: int
    manifest_key: str
    objects: int = 0
    bytes: int = 0
    problems: list[VerifyProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class _Needs:
    """What the handles expect of each object."""

    change_sets: dict[str, list[tuple[str, ChangeSetRef]]] = field(default_factory=dict)
    snapshots: dict[str, list[SnapshotRef]] = field(default_factory=dict)
    unlisted: list[tuple[str, str]] = field(default_factory=list)  # (task, key)
    #: a delta's key -> (its reference, the pieces before it in its handle, the handle's max
    #: parallelism), one per handle that names it: the chain a restore checks it against
    chains: dict[str, list[tuple[SnapshotRef, tuple[SnapshotRef, ...], int]]] = field(
        default_factory=dict)


def _needs(manifest: Manifest) -> _Needs:
    needs = _Needs()
    listed = {t.task_id: set(t.referenced_keys) for t in manifest.tasks}
    for t in task_states(manifest):
        keys = t.handle.referenced_keys()
        needs.unlisted.extend((t.task_id, k) for k in keys if k not in listed[t.task_id])
        pieces = t.handle.materialized
        for i, s in enumerate(pieces):
            needs.snapshots.setdefault(s.key, []).append(s)
            if s.delta:
                needs.chains.setdefault(s.key, []).append(
                    (s, pieces[:i], t.handle.max_parallelism))
        for h in t.handle.non_materialized:
            for r in h.change_sets:
                needs.change_sets.setdefault(r.key, []).append((h.log_id, r))
    return needs


def verify_checkpoint(catalog: CheckpointCatalog, checkpoint_id: int | None = None, *,
                      progress: Progress | None = None) -> VerifyReport:
    """Verify one checkpoint (``None``: the newest) of ``catalog``'s store.

    Returns:
        The report; ``report.ok`` when nothing is wrong.

    Raises:
        CheckpointNotFoundError: no such checkpoint.
        ConfigError: an argument of the wrong type or out of range.
    """
    check_instance(catalog, "catalog", "verify_checkpoint", CheckpointCatalog)
    check_checkpoint_id(checkpoint_id, "checkpoint_id", "verify_checkpoint")
    if progress is not None:
        check_callable(progress, "progress", "verify_checkpoint", args=3)
    stored = catalog.find(checkpoint_id)
    report = VerifyReport(stored.checkpoint_id, stored.key)
    try:
        manifest = catalog.load(stored)
        needs = _needs(manifest)
    except (CorruptObjectError, ObjectNotFoundError) as exc:
        report.problems.append(VerifyProblem(stored.key, exc))
        return report
    for task, key in needs.unlisted:
        report.problems.append(VerifyProblem(key, CorruptObjectError(
            stored.key, 0, f"task {task!r} needs {key} but does not list it in referenced_keys "
                           "(retention could delete it)")))
    keys = sorted(set(needs.change_sets) | set(needs.snapshots))
    for i, key in enumerate(keys):
        _verify_object(catalog, key, needs, report)
        if progress is not None:
            progress(i + 1, len(keys), report.bytes)
    return report


def _verify_object(catalog: CheckpointCatalog, key: str, needs: _Needs,
                   report: VerifyReport) -> None:
    try:
        data = catalog.store.get(key)
    except ObjectNotFoundError as exc:
        report.problems.append(VerifyProblem(key, exc))
        return
    report.objects += 1
    report.bytes += len(data)
    try:
        if key in needs.change_sets:
            _check_segment(data, key, needs.change_sets[key])
        if key in needs.snapshots:
            _check_snapshot(data, key, needs.snapshots[key], needs.chains.get(key, []))
    except CorruptObjectError as exc:
        report.problems.append(VerifyProblem(key, exc))


def _check_segment(data: bytes, key: str, refs: list[tuple[str, ChangeSetRef]]) -> None:
    seg = decode_segment(data, key)
    index = {e.offset: e for e in seg.entries}
    for log_id, r in refs:
        e = index.get(r.offset)
        if e is None or (e.length, e.log_id, e.sqn) != (r.length, log_id, r.sqn):
            got = "no record" if e is None else (f"a record of {e.log_id!r} sqn {e.sqn}, "
                                                 f"{e.length} bytes")
            raise CorruptObjectError(key, r.offset, f"the checkpoint names a change set of "
                                                    f"{log_id!r} sqn {r.sqn} ({r.length} bytes) "
                                                    f"here, the segment has {got}")


def _check_snapshot(data: bytes, key: str, refs: list[SnapshotRef],
                    chains: list[tuple[SnapshotRef, tuple[SnapshotRef, ...], int]]) -> None:
    delta = snapshot_version(data[:HEADER_SIZE]) == DELTA_VERSION
    for r in refs:
        if r.delta != delta:
            raise CorruptObjectError(key, 5, f"the checkpoint names a "
                                             f"{'delta' if r.delta else 'full snapshot'}, the "
                                             f"object is {'a delta' if delta else 'not'}")
    if delta:
        # every check a restore makes of the object: metadata, index, every entry's framing,
        # order, state and key group
        meta = decode_delta(data, key=key)[0]
        covered = meta.key_groups
        # and that it is the piece each handle's chain names (as a restore checks it)
        at = DeltaReader(BytesSource(data), key=key).metadata_offset
        for ref, earlier, max_parallelism in chains:
            check_delta_piece(ref, meta, at, earlier, max_parallelism)
    elif is_file_snapshot(data[:HEADER_SIZE]):
        covered = _file_snapshot_covers(data, key)
    else:
        covered = decode_snapshot(data, key=key).key_groups
    for r in refs:
        if r.size != len(data):
            raise CorruptObjectError(key, 0, f"the checkpoint says {r.size} bytes, the object "
                                             f"has {len(data)}")
        if r.key_groups.intersection(covered) != r.key_groups:
            raise CorruptObjectError(key, 0, f"the checkpoint says it covers key groups "
                                             f"{r.key_groups}, the snapshot covers {covered}")


def _file_snapshot_covers(data: bytes, key: str) -> KeyGroupRange:
    """Verify a v2 (file-level) snapshot whole, as a restore checks it
    (:func:`restore.file_restore.validate_file_snapshot`: object crc and structure, the data's
    zstd checksum and size, the LMDB file's every page and key), and return the key groups it
    covers."""
    view = memoryview(data)
    staged = validate_file_snapshot(lambda off, n: bytes(view[off:off + n]), len(data), key=key)
    _decode_values(staged, key)
    return staged.layout.meta.key_groups


def _decode_values(staged: StagedSnapshot, key: str) -> None:
    """Every namespace and value of a validated v2 file decodes with its state's codecs, as a
    heap restore and the readers decode them (an LMDB restore keeps them as stored and decodes
    them when read). States of the pickle codec are not decoded: that would run code from the
    store."""
    meta = staged.layout.meta
    shapes = {int(sid): state_info(m, False, key).shape for sid, m in meta.states.items()
              if m.get("raw") is not True and "pickle" not in (m.get("value_codec"),
                                                               m.get("key_codec"))}
    spans = staged.valid.spans
    head = spans.key_head.astype(np.uint64)
    sids = ((head >> np.uint64(32)) & np.uint64(0xFFFF)).astype(np.int64).tolist()
    ns_at = (spans.key_start + KEY_PREFIX.size + (head & np.uint64(0xFFFFFFFF)).astype(np.int64))
    key_end = spans.key_start + spans.key_size
    raw = spans.data
    valid = staged.valid
    framed = valid.codec is not None   # key layout "2": values decode through the file's codec
    for i, (sid, ns, end, v, n) in enumerate(zip(
            sids, ns_at.tolist(), key_end.tolist(), spans.value_start.tolist(),
            spans.value_size.tolist(), strict=True)):
        shape = shapes.get(sid)
        if shape is None:
            continue   # a reserved record, an internal raw state, a pickle state
        try:
            if end > ns:
                _NAMESPACES.decode(raw[ns:end].tobytes())
            shape.from_bytes(valid.value(i) if framed else raw[v:v + n].tobytes())
        except (DstlError, *DECODER_BUGS) as exc:
            raise placed(exc, key, staged.layout.data_offset,
                         f"entry {i} of the LMDB data file (state {sid})") from exc
