"""``ChangelogWriter``: the append-only log of one keyed state backend.

Theory of operation (Flink's ``FsStateChangelogWriter`` semantics, reference §1)
------------------------------------------------------------------------------
- **Change sets and sqns.** ``append`` adds a change to the *active* change set, which carries the
  active sqn. Any ``next_sqn()`` or ``persist()`` with a non-empty active set *rolls it over*: the
  set is frozen (:func:`dstl.segment.build_change_set`) into ``not_uploaded[sqn]`` and the active
  sqn moves on. So one sqn names one change set, sqns are dense in ``[lowest, active)``, and
  ``next_sqn()`` is an exclusive upper bound of everything appended so far. Empty change sets do
  not exist, so no empty object is ever uploaded.
- **persist(from, cp)** rolls over, then uploads every not-uploaded set with ``sqn >= from`` in
  one :class:`~dstl.scheduler.UploadTask`, reuses sets already uploaded, and — for sets being
  uploaded right now — only waits for them: every change set is uploaded at most once. The future
  resolves with a :class:`~dstl.handle.ChangelogHandle` for ``[from, to)`` once the whole range is
  durable. Checks, in Flink's order: a failed upload at ``sqn >= from`` (the *highest-failed*
  rule) raises :class:`~dstl.errors.WriterFailedError`; ``from`` below the truncation point or
  above the active sqn raises :class:`~dstl.errors.UsageError`.
- **Pre-emptive persist.** When the active set's bytes pass ``preemptive_persist_threshold_bytes``
  the writer persists from its oldest not-uploaded sqn without a checkpoint, so memory stays
  bounded and a later checkpoint has little left to send. Back-pressure from the scheduler blocks
  ``append`` here (and ``persist``).
- **Ownership.** Each uploaded change set holds one reference on its segment in the
  :class:`~dstl.registry.SegmentRegistry`. ``truncate(to)`` releases those below ``to``;
  ``truncate_and_close(from)`` releases those at or above ``from``; results arriving after their
  range was truncated or the writer closed are released on arrival. ``confirm`` hands the segments
  of a completed checkpoint to the coordinator. ``reset`` (checkpoint aborted) keeps uploads for
  reuse — state is never re-uploaded.
- **Pins (beyond Flink).** ``persist(from, cp)`` with ``cp >= 0`` pins every segment in the range
  until ``confirm``/``reset`` of that checkpoint, so truncation racing with an in-flight checkpoint
  can never delete a segment the checkpoint names (apache/flink#27599).

Threads: the writer is used by one owner thread (append/persist/truncate/...); upload callbacks
arrive on upload threads and touch only state guarded by ``_lock``. The active change set is owned
by the owner thread alone, which keeps ``append`` lock-free; its checks cost one fast test on the
common path (see ``append``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dstl.errors import (
    ClosedError,
    ConfigTypeError,
    DstlError,
    KeyGroupError,
    UsageError,
    WriterFailedError,
)
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange
from dstl.registry import SegmentRegistry
from dstl.scheduler import UploadScheduler, UploadTask
from dstl.segment import (
    BLOCK_HEAD_BYTES,
    BODY_HEAD_BYTES,
    CHANGE_LEN,
    DEFAULT_MAX_CHANGE_SET_BYTES,
    ChangeSet,
    build_change_set,
)

if TYPE_CHECKING:
    from dstl.metrics import MetricsRegistry

__all__ = ["ChangelogWriter"]

logger = logging.getLogger(__name__)

_pack_len = CHANGE_LEN.pack
#: Payloads shorter than this take their length prefix from ``_LEN_PREFIXES`` (one tuple index)
#: instead of packing a new 4-byte object per change; 1 KiB covers the usual state change record
#: and the table costs about 40 KB.
_PREFIXED_BELOW = 1024
_LEN_PREFIXES = tuple(_pack_len(n) for n in range(_PREFIXED_BELOW))


@dataclass(slots=True)
class _Listener:
    from_sqn: int
    to_sqn: int
    checkpoint_id: int
    future: Future[ChangelogHandle]
    incremental: int
    pinned: set[str] = field(default_factory=set)


class ChangelogWriter:
    """The append-only changelog of one backend. Create with ``ChangelogStorage.create_writer``."""

    def __init__(self, log_id: str, key_groups: KeyGroupRange, *,
                 scheduler: UploadScheduler, registry: SegmentRegistry,
                 preemptive_threshold_bytes: int, metrics: MetricsRegistry,
                 on_close: Callable[[ChangelogWriter], None] | None = None,
                 max_change_set_bytes: int = DEFAULT_MAX_CHANGE_SET_BYTES) -> None:
        self.log_id = log_id
        # A body holds its head and one header per block besides the framed changes.
        self._max_framed = max_change_set_bytes - BODY_HEAD_BYTES - len(log_id.encode("utf-8"))
        self._max_change_set = max_change_set_bytes
        self.key_groups = key_groups
        self._kg_start = key_groups.start
        self._kg_end = key_groups.end
        self._scheduler = scheduler
        self._registry = registry
        self._preemptive = preemptive_threshold_bytes
        self._on_close = on_close
        # active change set (owner thread only)
        self._blocks: dict[int, bytearray] = {}
        self._active_bytes = 0
        self._active_count = 0
        # append's fast path takes changes while _active_bytes stays at or below it (see append)
        self._fast_limit = -1
        # shared with upload callbacks (under _lock)
        self._lock = threading.Lock()
        self._active_sqn = 0
        self._lowest_sqn = 0
        self._not_uploaded: dict[int, ChangeSet] = {}
        self._uploading: set[int] = set()
        self._uploaded: dict[int, ChangeSetRef] = {}
        self._highest_failed: tuple[int, BaseException] | None = None
        self._listeners: list[_Listener] = []
        self._pins: dict[int, list[str]] = {}
        self._closed = False
        self._pid = os.getpid()
        self._m_preemptive = metrics.counter("numberOfPreemptivePersists")
        self._m_appended = metrics.counter("numberOfAppendedChangeSets")

    # ------------------------------------------------------------------ owner-thread API

    def append(self, key_group: int, payload: bytes | bytearray | memoryview) -> None:
        """Append one change to the active change set (no I/O unless a pre-emptive persist fires).

        Args:
            key_group: the change's key group (in the writer's range, or -1 for metadata).
            payload: the change record bytes (opaque to the log).

        Raises:
            ClosedError: the writer is closed.
            KeyGroupError: key group outside the writer's range.
            UsageError: payload is not bytes-like, or too large for one change set.
            UploadTimeoutError: a pre-emptive persist waited too long for upload capacity.
        """
        # The fast path answers every check of _append_checked with three cheap tests, so a
        # change costs them, two counter updates and the copy (its length prefix comes from a
        # table, not from a new packed object):
        # 1. Exact types. True, 1.0 or an int subclass hash like a valid key group but must be
        #    refused, and an unhashable one must not reach the dict; only bytes is framed as is.
        # 2. A hit in _blocks. A block exists only for a key group _append_checked accepted, and
        #    only while the writer is open (_close empties the blocks), so a hit means "open and
        #    in range" without comparing against the range.
        # 3. _fast_limit: the largest active byte count at which the change neither needs a
        #    rollover (max_change_set_bytes with the current blocks) nor fires a pre-emptive
        #    persist; one comparison stands for both.
        # Everything else (a key group's first change in this change set, a bytearray or
        # memoryview, a rollover, a persist, a closed writer, a bad argument) goes through
        # _append_checked, which raises the typed errors.
        if type(key_group) is int and type(payload) is bytes:
            buf = self._blocks.get(key_group)
            if buf is not None:
                size = len(payload)
                active = self._active_bytes + size + 4
                if active <= self._fast_limit:
                    buf += _LEN_PREFIXES[size] if size < _PREFIXED_BELOW else _pack_len(size)
                    buf += payload
                    self._active_bytes = active
                    self._active_count += 1
                    return
        self._append_checked(key_group, payload)

    def _append_checked(self, key_group: int, payload: bytes | bytearray | memoryview) -> None:
        """``append`` with every check spelled out; also keeps ``_fast_limit`` current."""
        if self._closed:
            raise ClosedError(f"changelog writer {self.log_id!r}", "append after close; the "
                                                                   "backend must be restored")
        if (type(key_group) is not int or not self._kg_start <= key_group <= self._kg_end) and (
                key_group != META_KEY_GROUP or type(key_group) is not int):
            raise KeyGroupError(key_group, f"changelog writer {self.log_id!r}",
                                self.key_groups, "route the key to the backend owning it")
        if type(payload) is not bytes:
            if not isinstance(payload, (bytearray, memoryview)):
                raise UsageError(f"changelog writer {self.log_id!r}: payload must be bytes, got "
                                 f"{type(payload).__name__} (encode it first)")
            payload = bytes(payload)
        buf = self._blocks.get(key_group)
        if self._active_bytes + len(payload) + 4 + BLOCK_HEAD_BYTES * (
                len(self._blocks) + (buf is None)) > self._max_framed:
            self._make_room(len(payload))
            buf = None
        if buf is None:
            buf = self._blocks[key_group] = bytearray()
        # Blocks are only added here, so the limit is set here; a rollover or close empties the
        # blocks, which sends the next change of every key group back here anyway.
        self._fast_limit = min(self._max_framed - BLOCK_HEAD_BYTES * len(self._blocks),
                               self._preemptive - 1)
        buf += _pack_len(len(payload))
        buf += payload
        self._active_bytes += len(payload) + 4
        self._active_count += 1
        if self._active_bytes >= self._preemptive:
            self._preemptive_persist()

    def _make_room(self, size: int) -> None:
        """Roll the active change set over so that a change of ``size`` bytes starts a new one
        below ``DstlOptions.max_change_set_bytes``; refuse a change that cannot fit alone."""
        if size + 4 + BLOCK_HEAD_BYTES > self._max_framed:
            raise UsageError(f"changelog writer {self.log_id!r}: a {size}-byte change does not "
                             f"fit in one change set of at most {self._max_change_set} bytes "
                             "(DstlOptions.max_change_set_bytes); split the state value or "
                             "raise the option (readers need the same)")
        self._rollover()

    def next_sqn(self) -> int:
        """Roll the active change set over (if non-empty) and return the active sqn.

        Everything appended so far has a smaller sqn; everything appended later a greater or
        equal one. Two calls without an append in between return the same value.
        """
        self._check_open()
        self._rollover()
        return self._active_sqn

    def persist(self, from_sqn: int, checkpoint_id: int) -> Future[ChangelogHandle]:
        """Make ``[from_sqn, next_sqn())`` durable; the future gives its handle.

        Args:
            from_sqn: inclusive start (usually the last materialized sqn).
            checkpoint_id: the checkpoint this is for (>= 0 pins the range's segments until
                ``confirm``/``reset``); -1 for a persist outside any checkpoint.

        Raises:
            ClosedError: the writer is closed.
            WriterFailedError: a change set at or above ``from_sqn`` failed to upload earlier.
            UsageError: ``from_sqn`` is below the truncation point or above the active sqn.
            UploadTimeoutError: back-pressure lasted longer than ``back_pressure_timeout_s``.
        """
        self._check_open()
        if os.getpid() != self._pid:
            raise UsageError(f"changelog writer {self.log_id!r} was created in process "
                             f"{self._pid}, not in this forked process; create the storage and "
                             "writers after the fork")
        if type(from_sqn) is not int or type(checkpoint_id) is not int:
            raise UsageError(f"persist({from_sqn!r}, {checkpoint_id!r}): sqn and checkpoint id "
                             "must be ints")
        with self._lock:
            failed = self._highest_failed
            if failed is not None and failed[0] >= from_sqn:
                raise WriterFailedError(self.log_id, failed[0]) from failed[1]
            if from_sqn < self._lowest_sqn:
                raise UsageError(f"changelog writer {self.log_id!r}: persist from sqn {from_sqn} "
                                 f"is below the truncation point {self._lowest_sqn} (those change "
                                 "sets were truncated; persist from the last materialized sqn)")
            if from_sqn > self._active_sqn:
                raise UsageError(f"changelog writer {self.log_id!r}: persist from sqn {from_sqn} "
                                 f"is beyond the active sqn {self._active_sqn}")
        self._rollover()
        return self._persist_internal(from_sqn, checkpoint_id)

    def truncate(self, to_sqn: int) -> None:
        """Drop change sets below ``to_sqn`` (exclusive) and release their segment references.

        Contract: ``[.., to_sqn)`` is materialized and no retained, not-subsumed checkpoint
        needs it (the backend's truncation rule ensures that).
        """
        _check_ints("truncate", to_sqn=to_sqn)
        released: list[str] = []
        with self._lock:
            if to_sqn > self._active_sqn:
                raise UsageError(f"changelog writer {self.log_id!r}: truncate to {to_sqn} is "
                                 f"beyond the active sqn {self._active_sqn}")
            if to_sqn <= self._lowest_sqn:
                return
            self._lowest_sqn = to_sqn
            for sqn in [s for s in self._not_uploaded if s < to_sqn]:
                del self._not_uploaded[sqn]
            for sqn in [s for s in self._uploaded if s < to_sqn]:
                released.append(self._uploaded.pop(sqn).key)
            doomed = [lst for lst in self._listeners if lst.from_sqn < to_sqn]
            for lst in doomed:
                self._listeners.remove(lst)
        for key in released:
            self._registry.release(key)
        for lst in doomed:
            _fail(lst.future, UsageError(f"changelog writer {self.log_id!r}: range "
                                         f"[{lst.from_sqn}, {lst.to_sqn}) was truncated to "
                                         f"{to_sqn} while it was being persisted"))

    def confirm(self, from_sqn: int, to_sqn: int, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` (covering ``[from, to)``) completed: hand its segments to
        the coordinator (the process will never delete them) and drop pins up to it."""
        _check_ints("confirm", from_sqn=from_sqn, to_sqn=to_sqn, checkpoint_id=checkpoint_id)
        keys: list[str] = []
        with self._lock:
            self._check_range("confirm", from_sqn, to_sqn)
            keys = [ref.key for sqn, ref in self._uploaded.items() if from_sqn <= sqn < to_sqn]
            # The range may have been truncated meanwhile; the checkpoint's pins still name
            # every segment it refers to, so hand those over too.
            keys.extend(self._pins.get(checkpoint_id, ()))
            keys = list(dict.fromkeys(keys))
            unpin = self._take_pins(lambda cp: cp <= checkpoint_id)
        for key in keys:
            self._registry.stop_tracking(key)
        self._registry.unpin(unpin)

    def reset(self, from_sqn: int, to_sqn: int, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` was aborted: keep the uploads for reuse, drop its pins."""
        _check_ints("reset", from_sqn=from_sqn, to_sqn=to_sqn, checkpoint_id=checkpoint_id)
        with self._lock:
            self._check_range("reset", from_sqn, to_sqn)
            unpin = self._take_pins(lambda cp: cp == checkpoint_id)
        self._registry.unpin(unpin)

    def truncate_and_close(self, from_sqn: int) -> None:
        """Release everything at or above ``from_sqn`` (never part of a checkpoint) and close.

        Change sets below ``from_sqn`` may be part of a checkpoint and stay untouched.
        """
        _check_ints("truncate_and_close", from_sqn=from_sqn)
        self._close(release_from=from_sqn)

    def close(self) -> None:
        """Close the writer. Uploaded change sets stay (a checkpoint may name them); pending
        persist futures fail with ``ClosedError``; idempotent."""
        self._close(release_from=None)

    @property
    def closed(self) -> bool:
        return self._closed

    def lowest_sqn(self) -> int:
        """The truncation point: sqns below it are gone."""
        return self._lowest_sqn

    def has_failed(self) -> BaseException | None:
        """The error of the highest failed change set, if any."""
        with self._lock:
            return self._highest_failed[1] if self._highest_failed else None

    def __repr__(self) -> str:
        return (f"ChangelogWriter({self.log_id!r}, {self.key_groups}, active_sqn="
                f"{self._active_sqn}, lowest_sqn={self._lowest_sqn})")

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"changelog writer {self.log_id!r}")

    def _check_range(self, op: str, from_sqn: int, to_sqn: int) -> None:
        if not 0 <= from_sqn <= to_sqn <= self._active_sqn:
            raise UsageError(f"changelog writer {self.log_id!r}: {op}({from_sqn}, {to_sqn}) needs "
                             f"0 <= from <= to <= active sqn {self._active_sqn}")

    def _take_pins(self, which: object) -> list[str]:
        out: list[str] = []
        for cp in [c for c in self._pins if which(c)]:  # type: ignore[operator]
            out.extend(self._pins.pop(cp))
        return out

    def _rollover(self) -> None:
        if not self._active_count:
            return
        sqn = self._active_sqn
        cs = build_change_set(self.log_id, sqn, self._blocks, self._active_count,
                              self._active_bytes - 4 * self._active_count)
        self._blocks = {}
        self._active_bytes = 0
        self._active_count = 0
        with self._lock:
            self._not_uploaded[sqn] = cs
            self._active_sqn = sqn + 1
        self._m_appended.inc()

    def _preemptive_persist(self) -> None:
        with self._lock:
            from_sqn = min(self._not_uploaded, default=self._active_sqn)
        self._m_preemptive.inc()
        self._rollover()
        self._persist_internal(from_sqn, -1)

    def _persist_internal(self, from_sqn: int, checkpoint_id: int) -> Future[ChangelogHandle]:
        fut: Future[ChangelogHandle] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            to_sqn = self._active_sqn
            to_upload = [cs for sqn, cs in sorted(self._not_uploaded.items()) if sqn >= from_sqn]
            for cs in to_upload:
                del self._not_uploaded[cs.sqn]
                self._uploading.add(cs.sqn)
            lst = _Listener(from_sqn, to_sqn, checkpoint_id, fut,
                            sum(cs.payload_bytes for cs in to_upload))
            if checkpoint_id >= 0:
                self._pin_for(lst, [ref.key for sqn, ref in self._uploaded.items()
                                    if from_sqn <= sqn < to_sqn])
            self._listeners.append(lst)
            ready = self._collect_ready()
        _complete(ready)
        if to_upload:
            try:
                self._scheduler.upload(UploadTask(to_upload, self._on_uploaded, self._on_failed))
            except DstlError as exc:
                # Closed or back-pressure deadline: these change sets will never be durable.
                self._on_failed(to_upload, exc)
                raise
        return fut

    def _pin_for(self, lst: _Listener, keys: list[str]) -> None:
        new = [k for k in dict.fromkeys(keys) if k not in lst.pinned]
        if not new:
            return
        pinned = self._registry.pin(new)
        lst.pinned.update(pinned)
        self._pins.setdefault(lst.checkpoint_id, []).extend(pinned)

    def _collect_ready(self) -> list[tuple[Future[ChangelogHandle], ChangelogHandle]]:
        ready = []
        uploaded = self._uploaded
        for lst in list(self._listeners):
            if all(s in uploaded for s in range(lst.from_sqn, lst.to_sqn)):
                self._listeners.remove(lst)
                refs = tuple(uploaded[s] for s in range(lst.from_sqn, lst.to_sqn))
                ready.append((lst.future, ChangelogHandle(self.log_id, self.key_groups,
                                                          lst.from_sqn, lst.to_sqn, refs,
                                                          lst.incremental)))
        return ready

    def _on_uploaded(self, pairs: list[tuple[ChangeSet, ChangeSetRef]]) -> None:
        late: list[str] = []
        with self._lock:
            for cs, ref in pairs:
                self._uploading.discard(cs.sqn)
                if self._closed or cs.sqn < self._lowest_sqn:
                    late.append(ref.key)
                    continue
                self._uploaded[cs.sqn] = ref
                for lst in self._listeners:
                    if lst.checkpoint_id >= 0 and lst.from_sqn <= cs.sqn < lst.to_sqn:
                        self._pin_for(lst, [ref.key])
            ready = self._collect_ready()
        for key in late:
            self._registry.release(key)
        _complete(ready)

    def _on_failed(self, change_sets: list[ChangeSet], exc: BaseException) -> None:
        with self._lock:
            top = max(cs.sqn for cs in change_sets)
            for cs in change_sets:
                self._uploading.discard(cs.sqn)
            if self._highest_failed is None or top > self._highest_failed[0]:
                self._highest_failed = (top, exc)
            sqns = {cs.sqn for cs in change_sets}
            failed = [lst for lst in self._listeners
                      if any(lst.from_sqn <= s < lst.to_sqn for s in sqns)]
            unpin: list[str] = []
            for lst in failed:
                self._listeners.remove(lst)
                if lst.checkpoint_id >= 0:
                    unpin.extend(self._take_pins(lambda cp, c=lst.checkpoint_id: cp == c))
        logger.warning("changelog writer %r: change sets %s..%s failed to upload: %s",
                       self.log_id, min(sqns), top, exc)
        self._registry.unpin(unpin)
        for lst in failed:
            _fail(lst.future, exc)

    def _close(self, release_from: int | None) -> None:
        released: list[str] = []
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if release_from is not None:
                for sqn in [s for s in self._uploaded if s >= release_from]:
                    released.append(self._uploaded.pop(sqn).key)
            self._not_uploaded.clear()
            pending, self._listeners = self._listeners, []
            unpin = self._take_pins(lambda cp: True)
        self._blocks = {}
        self._active_bytes = self._active_count = 0
        self._fast_limit = -1
        for key in released:
            self._registry.release(key)
        self._registry.unpin(unpin)
        for lst in pending:
            _fail(lst.future, ClosedError(f"changelog writer {self.log_id!r}",
                                          "closed before the persist completed"))
        if self._on_close is not None:
            self._on_close(self)
        logger.debug("changelog writer %r closed (released %d change sets)", self.log_id,
                     len(released))


def _complete(ready: list[tuple[Future[ChangelogHandle], ChangelogHandle]]) -> None:
    for fut, handle in ready:
        if not fut.done():
            fut.set_result(handle)


def _fail(fut: Future[ChangelogHandle], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _check_ints(op: str, **values: object) -> None:
    """Refuse a sequence number or checkpoint id that is not an ``int`` (a ``bool``, float,
    string or ``None`` would otherwise fail deep inside a comparison with a bare ``TypeError``)."""
    for field_name, value in values.items():
        if type(value) is not int:
            raise ConfigTypeError(field_name, value, "an int", owner=f"ChangelogWriter.{op}",
                                  fix="sequence numbers and checkpoint ids are ints")
