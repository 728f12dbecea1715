"""The change feed: which checkpoints a feed covers (:func:`plan_change_range`, reads manifests)
and the changes of one split (:func:`read_change_split`, reads change sets).

Theory of operation
-------------------
*Planning* lists the retained checkpoints, loads the start's manifest and every one after it up
to the end, and hands them to the pure :func:`~dstl.reader.plan.plan_changes`, reading the
boundary of a snapshot only when one first appears (its footer, index and metadata block: three
small ranged reads). A start the store no longer retains is a
:class:`~dstl.reader.errors.ChangesLostError` naming the checkpoints whose changes are gone —
or, with ``on_lost="oldest"``, the plan starts at the oldest retained checkpoint and says what
it skipped. A start of ``None`` is the empty state: the first retained checkpoint's state comes
out as differences against nothing, so a consumer that starts before (or long after) the job
still sees a complete history of the state.

*Reading* a split fetches its change sets with exact ranged reads (adjacent records coalesced),
or through a restore cache, each verified on its own; decodes every change of the split's key
groups with the codecs its state's metadata record names (the metadata records of a checkpoint's
first change sets; for a state first named in an earlier set of the same handle, those sets'
metadata is read too); and turns each record into elementary rows
(:class:`~dstl.reader.rows.ChangeRow`), numbered by ``seq`` in log order. A split with a
:class:`~dstl.reader.plan.GapFill` first restores the previous checkpoint and the snapshot cut
(read-only, as the state reader does) and emits their difference.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from dstl.checks import check_bool, check_choice, check_instance
from dstl.envelope import HEADER_SIZE
from dstl.errors import ConfigError, CorruptObjectError, ObjectNotFoundError
from dstl.handle import ChangelogHandle
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange
from dstl.reader.catalog import CheckpointCatalog, task_states
from dstl.reader.checks import check_cache, check_checkpoint_id
from dstl.reader.errors import ChangesLostError, CheckpointNotFoundError
from dstl.reader.image import StateImage
from dstl.reader.plan import ChangeSplit, CheckpointView, GapFill, LogRun, plan_changes
from dstl.reader.rows import ChangeRow
from dstl.reader.state import translate_missing
from dstl.stores.base import BlobStore
from materializer.changes import decode_change, decode_metadata, op_rows
from materializer.codecs import SafeCodec, StrOrBytesKeyCodec, codec_by_name
from materializer.delta_format import DELTA_VERSION
from materializer.file_snapshot import read_file_snapshot_layout, snapshot_version
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.state_tables import BlobRangeSource, SnapshotReader
from materializer.states import StateShape
from restore.file_restore import is_file_snapshot
from restore.leasing import LeasingCache
from restore.reader import ChangelogReader
from restore.restore import plan_restore

__all__ = ["ChangePlan", "OnLost", "plan_change_range", "read_change_split", "snapshot_boundary"]

OnLost = Literal["fail", "oldest"]


@dataclass(frozen=True, slots=True)
class ChangePlan:
    """A planned feed.

    Attributes:
        start: the checkpoint the feed starts after (``-1``: the empty state).
        end: the last checkpoint it covers (``-1``: none yet: nothing to read).
        splits: in checkpoint order, then task order.
        lost: ``(requested start, oldest retained)`` when ``on_lost="oldest"`` skipped changes.
        max_parallelism: the job's number of key groups (``0`` when nothing was planned).
    """

    start: int
    end: int
    splits: tuple[ChangeSplit, ...]
    lost: tuple[int, int] | None = None
    max_parallelism: int = 0


def snapshot_boundary(store: BlobStore, ref: SnapshotRef) -> tuple[str, int] | None:
    """The ``boundary`` a snapshot's metadata records (the last change set it reflects), or
    ``None``.

    Raises:
        CorruptObjectError: the snapshot's tail or metadata block is damaged.
    """
    head = store.get_range(ref.key, 0, HEADER_SIZE)
    if ref.delta or snapshot_version(head) == DELTA_VERSION:
        # a delta records no boundary: the changes it cut out of the log come back as the
        # difference of the two checkpoints' states (a gap fill, which reads chains)
        return None
    if is_file_snapshot(head):
        layout = read_file_snapshot_layout(lambda off, n: store.get_range(ref.key, off, n),
                                           ref.size, key=ref.key)
        return layout.meta.boundary
    reader = SnapshotReader(BlobRangeSource(store, ref.key, ref.size), key=ref.key)
    try:
        b = json.loads(reader.metadata).get("boundary")
    except (ValueError, AttributeError) as exc:
        raise CorruptObjectError(ref.key, 0, f"snapshot metadata is not DSTL's: {exc}") from exc
    if isinstance(b, list) and len(b) == 2 and isinstance(b[0], str) and isinstance(b[1], int):
        return b[0], b[1]
    return None


def plan_change_range(catalog: CheckpointCatalog, start: int | None, end: int | None = None, *,
                      on_lost: OnLost = "fail", key_groups: Iterable[int] | None = None,
                      lost_option: str = "on_lost='oldest'") -> ChangePlan:
    """Plan the feed of the changes after checkpoint ``start`` up to ``end``.

    Args:
        catalog: the store's checkpoints.
        start: exclusive; ``None`` or ``-1``: from the empty state.
        end: inclusive; ``None``: the newest checkpoint.
        on_lost: what a start the store no longer retains does: ``"fail"`` raises
            :class:`ChangesLostError`; ``"oldest"`` starts after the oldest retained checkpoint.
        key_groups: only these key groups (a pushed-down filter).
        lost_option: how the caller names the ``"oldest"`` choice (for the error message).

    Raises:
        ChangesLostError: ``start`` is no longer retained and ``on_lost="fail"``.
        CheckpointNotFoundError: ``end`` is not in the store.
        CorruptObjectError: a manifest or snapshot tail is damaged.
        ConfigError: an argument of the wrong type or out of range.
    """
    owner = "plan_change_range"
    check_instance(catalog, "catalog", owner, CheckpointCatalog)
    check_checkpoint_id(start, "start", owner, lo=-1)
    check_checkpoint_id(end, "end", owner)
    check_choice(on_lost, "on_lost", owner, ("fail", "oldest"))
    if start is not None and end is not None and start > end:
        raise ConfigError("start", start, f"at most end ({end})", owner=owner,
                          fix="the feed is (start, end]")
    listed = catalog.checkpoints()
    ids = [c.checkpoint_id for c in listed]
    start, end, lost = _resolve_range(ids, start, end, on_lost, catalog.location, lost_option)
    if end < 0 or start >= end:
        return ChangePlan(start, max(start, end), (), lost)
    by_id = {c.checkpoint_id: c for c in listed}

    def view(cid: int) -> CheckpointView:
        return CheckpointView(cid, tuple(task_states(catalog.load(by_id[cid]))))

    first = view(start) if start >= 0 else None
    after = [view(c) for c in ids if start < c <= end]
    cache: dict[str, tuple[str, int] | None] = {}

    def boundary(ref: SnapshotRef) -> tuple[str, int] | None:
        if ref.key not in cache:
            cache[ref.key] = snapshot_boundary(catalog.store, ref)
        return cache[ref.key]

    try:
        splits = plan_changes(first, after, boundary, key_groups=key_groups)
    except ObjectNotFoundError as exc:
        raise translate_missing(catalog.store, end, exc) from exc
    mp = next((t.handle.max_parallelism for cp in after for t in cp.tasks), 0)
    return ChangePlan(start, end, tuple(splits), lost, mp)


def _resolve_range(ids: list[int], start: int | None, end: int | None, on_lost: OnLost,
                   location: str, lost_option: str
                   ) -> tuple[int, int, tuple[int, int] | None]:
    """``(start, end, lost)`` of a feed over the retained checkpoints ``ids`` (ascending):
    ``end`` defaults to the newest, a ``start`` no longer retained fails or, with ``on_lost=
    "oldest"``, moves to the oldest retained one (``lost`` = (asked, used))."""
    if end is None:
        end = ids[-1] if ids else -1
    elif end not in ids:
        raise CheckpointNotFoundError(end, location, ids)
    start = -1 if start is None else start
    lost = None
    if start >= 0 and start not in ids and start < end:
        oldest = ids[0] if ids else None
        if on_lost != "oldest" or oldest is None or start > oldest:
            raise ChangesLostError(start, oldest, location, lost_option)
        lost, start = (start, oldest), oldest
    return start, end, lost


# --------------------------------------------------------------------------- reading


class _Registry:
    """The states a handle's log describes (state id -> name, kind, codecs)."""

    def __init__(self, allow_pickle: bool) -> None:
        self._allow_pickle = allow_pickle
        self.states: dict[int, tuple[str, str, StateShape]] = {}
        self.raw: set[int] = set()

    def learn(self, payload: bytes) -> None:
        sid, meta = decode_metadata(payload)
        codec = codec_by_name(meta.get("value_codec") or "safe", allow_pickle=self._allow_pickle)
        kc = meta.get("key_codec")
        key_codec = codec_by_name(kc, allow_pickle=self._allow_pickle) if kc else None
        self.states[sid] = (meta["name"], meta["kind"], StateShape(meta["kind"], codec, key_codec))
        if meta.get("raw") is True:  # an internal index (raw bytes, no codecs): not shown
            self.raw.add(sid)


_KEYS = StrOrBytesKeyCodec()
_SAFE = SafeCodec()


def _sub_handle(h: ChangelogHandle, start: int, end: int) -> ChangelogHandle:
    refs = h.change_sets[start:end]
    return ChangelogHandle(h.log_id, h.key_groups, refs[0].sqn, refs[-1].sqn + 1, refs,
                           restrict=h.restrict)


class _SplitReader:
    """Reads one :class:`ChangeSplit` (see the module docstring)."""

    def __init__(self, store: BlobStore, split: ChangeSplit, cache: LeasingCache | None,
                 allow_pickle: bool) -> None:
        self.store = store
        self.split = split
        self.cache = cache
        self.allow_pickle = allow_pickle
        self.range = KeyGroupRange(*split.key_groups)
        self.wanted: Container[int] = (frozenset(split.only) if split.only is not None
                                       else self.range)
        self.seq = 0
        self.reader = ChangelogReader(store, cache=cache)

    def _row(self, kg: int, key_bytes: bytes, state: str, kind: str, ns: Any, op: str,
             user_key: Any, value: Any, source: str) -> ChangeRow:
        row = ChangeRow(self.split.checkpoint_id, self.split.task_id, kg, self.seq,
                        _KEYS.decode(key_bytes), key_bytes, state, kind, ns, op, user_key, value,
                        source)
        self.seq += 1
        return row

    def rows(self) -> Iterator[ChangeRow]:
        if self.split.gap is not None:
            yield from self._gap_rows(self.split.gap)
        for run in self.split.runs:
            yield from self._run_rows(run)

    def _run_rows(self, run: LogRun) -> Iterator[ChangeRow]:
        h = ChangelogHandle.from_json(run.handle)
        registry = _Registry(self.allow_pickle)
        looked_back = run.start == 0
        scope = h.replay_key_groups  # a restricted handle stands for part of its log only
        for kg, payload in self.reader.read(_sub_handle(h, run.start, run.end), self.wanted):
            if kg == META_KEY_GROUP:
                registry.learn(payload)
                continue
            if kg not in scope:
                continue
            ch = decode_change(payload)
            if ch.state_id not in registry.states and not looked_back:
                looked_back = True
                self._learn_earlier(h, run.start, registry)
            found = registry.states.get(ch.state_id)
            if found is None:
                raise CorruptObjectError(f"{h.log_id} (segments {sorted(h.segment_keys())[:3]})",
                                         0, f"change for state id {ch.state_id} has no metadata "
                                            "record in its log")
            if ch.state_id in registry.raw:
                continue
            name, kind, shape = found
            ns = _ns(ch.namespace)
            for op, uk, value in op_rows(ch.op, shape, ch.payload):
                yield self._row(kg, ch.key, name, kind, ns, op, uk, value, "log")

    def _learn_earlier(self, h: ChangelogHandle, upto: int, registry: _Registry) -> None:
        """Metadata records of the handle's change sets before the run (metadata only: key
        group -1 is always read, no data key group is)."""
        known = dict(registry.states)
        for kg, payload in self.reader.read(_sub_handle(h, 0, upto), frozenset()):
            if kg == META_KEY_GROUP:
                registry.learn(payload)
        registry.states.update(known)  # the run's own records win

    def _gap_rows(self, gap: GapFill) -> Iterator[ChangeRow]:
        rng = self.range
        if self.split.only is not None:
            rng = KeyGroupRange(min(self.split.only), max(self.split.only))
        before = self._image([ChangelogStateBackendHandle.from_json(j) for j in gap.previous],
                             rng)
        after = self._image([ChangelogStateBackendHandle.from_json(gap.cut)], rng)
        for ident, (kind, value) in after.items():
            old = before.pop(ident, None)
            if old is None or old[1] != value:
                name, kg, kb, nb = ident
                yield self._row(kg, kb, name, kind, _ns(nb), "set", None, value, "snapshot")
        for (name, kg, kb, nb), (kind, _) in before.items():
            yield self._row(kg, kb, name, kind, _ns(nb), "clear", None, None, "snapshot")

    def _image(self, handles: list[ChangelogStateBackendHandle], rng: KeyGroupRange
               ) -> dict[tuple[str, int, bytes, bytes], tuple[str, Any]]:
        """Every entry of ``handles``' state in the split's key groups, decoded: (state, kg,
        key bytes, namespace bytes) -> (kind, value). Built like a state read
        (:class:`~dstl.reader.image.StateImage`); values are compared decoded, as the same value
        can be encoded differently."""
        image = StateImage(self.allow_pickle)
        if handles:
            plan = plan_restore(handles, rng, operator_id="dstl-reader")
            image.load(self.store, plan.snapshots, rng, self.cache,
                       max_parallelism=plan.max_parallelism)
            for h in plan.logs:
                if h.change_sets:
                    image.replay(self.reader, h, rng.intersection(h.replay_key_groups))
        return {(info.name, kg, kb, nb): (info.kind, info.shape.from_bytes(vb))
                for info, kg, kb, nb, vb in image.rows() if kg in self.wanted and not info.raw}


def _ns(nb: bytes) -> Any:
    return _SAFE.decode(nb) if nb else None


def read_change_split(store: BlobStore, split: ChangeSplit, *, cache: LeasingCache | None = None,
                      allow_pickle: bool = False) -> Iterator[ChangeRow]:
    """The changes of one split, in log order (``seq`` counts from 0).

    Args:
        store: the job's store.
        split: from :func:`plan_change_range` / :func:`~dstl.reader.plan.plan_changes`.
        cache: a restore cache for segments (``None``: exact ranged reads).
        allow_pickle: decode states whose codec is ``pickle`` (runs code from the store).

    Raises:
        CheckpointDeletedError: the checkpoint was deleted while it was read.
        ObjectNotFoundError, CorruptObjectError: a change set is missing or damaged.
        UsageError: a state uses the pickle codec and ``allow_pickle`` is off.
    """
    owner = "read_change_split"
    check_instance(split, "split", owner, ChangeSplit)
    check_bool(allow_pickle, "allow_pickle", owner)
    check_cache(cache, owner)
    return _rows(_SplitReader(store, split, cache, allow_pickle))


def _rows(reader: _SplitReader) -> Iterator[ChangeRow]:
    try:
        yield from reader.rows()
    except ObjectNotFoundError as exc:
        raise translate_missing(reader.store, reader.split.checkpoint_id, exc) from exc
