"""The checkpoint manifest codec — pure values in, values out, no I/O.

Theory of operation
-------------------
A checkpoint exists iff its manifest exists (guarantee G3). The manifest is the LAST object a
checkpoint writes: every segment and snapshot it names was stored (and acknowledged by its task)
before the coordinator puts it. The store is write-once, so a checkpoint id that is committed
again (Spark re-runs a micro-batch, or a failed manifest put is retried) gets a new *attempt*::

    checkpoints/{checkpoint_id:016x}-{attempt:04x}.manifest      attempt = 1, 2, ...

Names are fixed-width lowercase hex, so lexical order is numeric order: a reader takes the highest
attempt of the highest checkpoint id. The names are made and recognised by :mod:`dstl.layout`
(:func:`~dstl.layout.manifest_key`, :func:`~dstl.layout.parse_manifest_key`).

**Encoding.** One canonical JSON document (sorted keys, no whitespace, ASCII only, no NaN/Infinity)
plus a newline::

    {"body":{...},"crc32":"<8 lowercase hex>","format":"dstl-manifest","version":2}

``crc32`` is CRC-32 over the canonical JSON encoding of ``body``. The body holds the job id,
checkpoint id, attempt, creation time, the job's retention (how many checkpoints its coordinator
keeps — ``dstl gc`` never keeps fewer), one entry per task (task id, its opaque JSON state handle,
the object keys it references, full and incremental size) and the checkpoint statistics (trigger
time, duration, per-task acknowledgement latency, total sizes). The field table is in
``docs/format.md`` ("Manifest").

**Versions.** Version 2 added ``body.retained``. Version-1 manifests (written before it) stay
readable: their retention is ``None``, "unknown", and ``dstl gc`` is conservative with them.
Version 3 added ``body.properties``: the job's own small values committed with the checkpoint
(the Spark operator's watermark), a JSON object of at most ``MAX_PROPERTIES`` names (identifier
characters, at most 64) to JSON scalars (integers in the signed 64-bit range, finite floats,
strings of at most 1024 characters, booleans, null). A manifest is encoded in the version its
fields need (3 with properties, else 2, or 1 when it records no retention), so decoding and
encoding round-trip and a job without properties writes exactly what it wrote before.

**Decoding is strict** — a checkpoint directory is untrusted input. In order: size limit
(:data:`MAX_MANIFEST_BYTES`, or the caller's), then — **before any JSON is parsed** — the CRC over
the raw body bytes: a canonical manifest is ``{"body":`` + the body's canonical encoding +
``,"crc32":"<hex>","format":"dstl-manifest","version":<n>}`` + newline, so the tail gives the CRC,
the format and the version, and the bytes between are exactly what the CRC covers (a document
that does not end like a manifest is parsed only if it is small, to say what it is instead). Then
UTF-8, JSON (no NaN/Infinity, nesting at most :data:`~dstl.untrusted.MAX_JSON_DEPTH`), format and
version (:class:`UnsupportedFormatError`), the CRC again over the parsed body, canonical form (so
that *every* altered byte is detected, not only those the CRC covers), then every field's type and
range and the cross-field rules (:class:`CorruptManifestError` naming the field). Every referenced
key goes through
:func:`~dstl.stores.base.check_key` and must lie under ``dstl/`` or ``snapshots/``
(:data:`dstl.layout.REFERENCE_PREFIXES`; else :class:`UnsafeManifestKeyError`), so a manifest can
neither point outside the storage root nor make the coordinator delete anything but segments and
snapshots. All of these are
:class:`~dstl.errors.CorruptObjectError` s naming the manifest's key.

Building a manifest from caller values (:meth:`Manifest.build`, :class:`TaskEntry`) applies the
same rules but raises :class:`~dstl.errors.UsageError` (:class:`~dstl.errors.UnsafePathError` for
keys): then it is the caller's mistake, not damaged data.

What a completion keeps and deletes is decided from the manifests' key sets by
:mod:`dstl.checkpoint.retention`.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from dstl.checkpoint.retention import CheckpointRefs
from dstl.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    UnsafePathError,
    UnsupportedFormatError,
    UsageError,
)
from dstl.layout import (
    MAX_ATTEMPT,
    MAX_CHECKPOINT_ID,
    REFERENCE_PREFIXES,
    manifest_key,
    parse_manifest_key,
)
from dstl.stores.base import check_key
from dstl.untrusted import load_json

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_PROPERTIES",
    "MAX_RETAINED",
    "PROPERTIES_VERSION",
    "READ_VERSIONS",
    "CheckpointStats",
    "CorruptManifestError",
    "Manifest",
    "TaskEntry",
    "UnsafeManifestKeyError",
    "check_properties",
    "decode_manifest",
    "encode_manifest",
    "validate_id",
]

#: Value of the top-level ``format`` field.
FORMAT_NAME = "dstl-manifest"
#: The manifest format this build writes without properties (a manifest without a recorded
#: retention, decoded from version 1, is written back as version 1; one with properties as 3).
FORMAT_VERSION = 2
#: The format of a manifest that carries ``body.properties``.
PROPERTIES_VERSION = 3
#: The manifest formats this build reads. Version 2 added ``body.retained``, 3
#: ``body.properties``.
READ_VERSIONS = (1, 2, 3)
#: At most this many properties per manifest.
MAX_PROPERTIES = 64
_PROPERTY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_MAX_PROPERTY_TEXT = 1024
#: Largest retention (checkpoints kept) a manifest may record; recovery reads that many.
MAX_RETAINED = 1000
#: Larger manifests are rejected before parsing, and a coordinator refuses to commit one
#: (untrusted input must not exhaust memory: parsing JSON can take 30 times its size). A manifest
#: holds keys and handles; 1,000 tasks with 100 keys and 100 change sets each stay below this.
#: ``CheckpointCoordinator(max_manifest_bytes=...)`` and ``decode_manifest(max_bytes=...)``
#: override it.
MAX_MANIFEST_BYTES = 16 << 20
#: A document that does not end like a manifest is parsed (to say what it is) only up to this.
_PARSE_UNFRAMED_BYTES = 64 << 10
_BODY_PREFIX = b'{"body":'
_TAIL = re.compile(rb',"crc32":"([0-9a-f]{8})","format":"([^"\\]{0,64})","version":(\d{1,9})\}\n\Z')
_TAIL_SEARCH_BYTES = 160
#: Ids, task ids and job ids longer than this are rejected (they end up in messages and logs).
MAX_ID_CHARS = 1024

_READABLE = f"{FORMAT_NAME} " + ", ".join(f"v{v}" for v in READ_VERSIONS)
_TOP_FIELDS = frozenset({"body", "crc32", "format", "version"})
_BODY_FIELDS_V1 = frozenset({"attempt", "checkpoint_id", "created_ms", "job_id", "stats",
                             "tasks"})
_BODY_FIELDS = {1: _BODY_FIELDS_V1, 2: _BODY_FIELDS_V1 | {"retained"},
                3: _BODY_FIELDS_V1 | {"retained", "properties"}}
_TASK_FIELDS = frozenset({"full_size", "incremental_size", "referenced_keys", "state",
                          "task_id"})
_STATS_FIELDS = frozenset({"ack_latency_ms", "duration_ms", "full_size", "incremental_size",
                           "trigger_ms"})


# --------------------------------------------------------------------------- errors


class CorruptManifestError(CorruptObjectError):
    """A stored manifest does not decode: a field is missing, has the wrong type or range, or
    contradicts another field.

    Attributes:
        key: the manifest's object key.
        field: the offending field, as a path (``body.tasks[2].referenced_keys[0]``).
    """

    def __init__(self, key: str, field: str, reason: str,
                 hint: str = "the manifest is damaged or was not written by DSTL; recover with "
                             "fallback=True to use the previous valid checkpoint") -> None:
        self.field = field
        super().__init__(key, 0, f"manifest field {field}: {reason}", hint)


class UnsafeManifestKeyError(CorruptManifestError, UnsafePathError):
    """A manifest names an object key that could escape the storage root, or that lies outside
    ``dstl/`` and ``snapshots/``. It is both a :class:`CorruptManifestError` (the manifest is
    bad) and an :class:`~dstl.errors.UnsafePathError` (the key is refused).

    Attributes:
        key: the manifest's object key.
        object_key: the refused key, as found in the manifest.
        field: where it was found.
        reason: why it is refused.
    """

    def __init__(self, key: str, field: str, object_key: str, reason: str) -> None:
        # Not cooperative: the two bases' constructors take different arguments.
        self.key = key  # the manifest (CorruptObjectError's meaning); the refused key follows
        self.object_key = object_key
        self.offset = 0
        self.field = field
        self.reason = reason
        Exception.__init__(
            self, f"{key} at offset 0: manifest field {field}: object key {object_key!r} is "
                  f"not allowed: {reason} (manifests may only name keys below dstl/ or "
                  "snapshots/ of the storage root; do not restore from this manifest)")


# ----------------------------------------------------------------------------------- validation

_Fail = Callable[[str, str], NoReturn]


def _usage(field: str, reason: str) -> NoReturn:
    raise UsageError(f"checkpoint manifest field {field}: {reason}")


def validate_id(value: object, field: str) -> str:
    """Return ``value`` if it is a usable job or task id (non-empty string, at most
    ``MAX_ID_CHARS`` characters, no control characters).

    Raises:
        UsageError: it is not; the message names ``field``.
    """
    return _check_id(value, field, _usage)


def _check_int_range(v: object, lo: int, hi: int | None, field: str, fail: _Fail) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        fail(field, f"expected an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        fail(field, f"{v} is out of range [{lo}, {hi if hi is not None else 'inf'}]")
    return v


def _check_number(v: object, field: str, fail: _Fail) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        fail(field, f"expected a number, got {type(v).__name__}")
    if not math.isfinite(v) or v < 0:
        fail(field, f"{v!r} is not a finite number >= 0")
    return float(v)


def check_properties(props: object, fail: _Fail) -> Mapping[str, Any]:
    """``props`` if it is a valid properties object (module docstring), else ``fail``."""
    if not isinstance(props, Mapping):
        fail("properties", f"expected an object, got {type(props).__name__}")
    if len(props) > MAX_PROPERTIES:
        fail("properties", f"{len(props)} properties; at most {MAX_PROPERTIES}")
    for name, v in props.items():
        if not isinstance(name, str) or _PROPERTY_NAME.fullmatch(name) is None:
            fail("properties", f"name {name!r:.80} is not 1-64 identifier characters")
        where = f"properties.{name}"
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, int):
            _check_int_range(v, -(1 << 63), (1 << 63) - 1, where, fail)
        elif isinstance(v, float):
            if not math.isfinite(v):
                fail(where, f"{v!r} is not finite")
        elif isinstance(v, str):
            if len(v) > _MAX_PROPERTY_TEXT or any(ord(c) < 0x20 for c in v):
                fail(where, f"longer than {_MAX_PROPERTY_TEXT} characters or has control "
                            "characters")
        else:
            fail(where, f"expected a JSON scalar, got {type(v).__name__}")
    return props


def _check_id(v: object, field: str, fail: _Fail) -> str:
    if not isinstance(v, str) or not v:
        fail(field, f"expected a non-empty string, got {v!r:.80}")
    if len(v) > MAX_ID_CHARS or any(ord(c) < 0x20 for c in v):
        fail(field, f"{v!r:.80} is longer than {MAX_ID_CHARS} characters or has control "
                    "characters")
    return v


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def _check_ref(v: object, field: str, *, manifest: str | None) -> str:
    """A referenced object key: safe (check_key) and below a referenceable prefix."""
    try:
        key = check_key(v)
    except UnsafePathError as exc:
        if manifest is None:
            raise
        raise UnsafeManifestKeyError(manifest, field, repr(v) if not isinstance(v, str) else v,
                                     exc.reason) from exc
    if not key.startswith(REFERENCE_PREFIXES):
        reason = f"not below {' or '.join(REFERENCE_PREFIXES)}"
        if manifest is None:
            raise UnsafePathError(key, reason + " (a checkpoint references segments and "
                                                "snapshots only)")
        raise UnsafeManifestKeyError(manifest, field, key, reason)
    return key


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class TaskEntry:
    """What one task contributed to a checkpoint.

    Attributes:
        task_id: the task (e.g. ``"count/3"``), unique within the checkpoint.
        state: the task's state handle, an opaque JSON object (the coordinator stores it as is).
        referenced_keys: every object the state needs (segments and snapshots), sorted, unique.
        full_size: bytes of the task's whole checkpointed state.
        incremental_size: bytes uploaded for this checkpoint only.
    """

    task_id: str
    state: Mapping[str, Any]
    referenced_keys: tuple[str, ...]
    full_size: int
    incremental_size: int

    @classmethod
    def of(cls, task_id: str, state: Mapping[str, Any], referenced_keys: Iterable[str],
           full_size: int, incremental_size: int) -> TaskEntry:
        """Validate caller values and build an entry (keys sorted and de-duplicated; the state
        copied through JSON, so later changes by the caller do not leak in).

        Raises:
            UsageError: a field has the wrong type or range, or the state is not a JSON object
                of strings, finite numbers, booleans, null, lists and objects.
            UnsafePathError: a key could escape the storage root or is not below ``dstl/`` or
                ``snapshots/``.
        """
        _check_id(task_id, "task_id", _usage)
        if not isinstance(state, Mapping):
            _usage("state", f"expected a JSON object (dict), got {type(state).__name__}")
        try:
            copied = json.loads(_canonical(dict(state)))
        except (TypeError, ValueError, RecursionError) as exc:
            _usage("state", f"task {task_id!r}: not JSON-serializable ({exc})")
        if isinstance(referenced_keys, (str, bytes)):
            _usage("referenced_keys", "expected a sequence of keys, got a single string")
        keys = tuple(sorted({_check_ref(k, "referenced_keys", manifest=None)
                             for k in referenced_keys}))
        _check_int_range(full_size, 0, None, "full_size", _usage)
        _check_int_range(incremental_size, 0, None, "incremental_size", _usage)
        return cls(task_id, copied, keys, full_size, incremental_size)

    def to_json_obj(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "state": dict(self.state),
                "referenced_keys": list(self.referenced_keys), "full_size": self.full_size,
                "incremental_size": self.incremental_size}


@dataclass(frozen=True, slots=True)
class CheckpointStats:
    """Statistics kept with a manifest (Flink's checkpoint stats).

    Attributes:
        trigger_ms: wall-clock time of the trigger, epoch ms (informational; retention never
            looks at it).
        duration_ms: trigger to commit, measured with the coordinator's monotonic clock.
        ack_latency_ms: per task, trigger to its (last) acknowledgement.
        full_size: sum of the tasks' full sizes.
        incremental_size: sum of the tasks' incremental sizes.
    """

    trigger_ms: int
    duration_ms: float
    ack_latency_ms: Mapping[str, float]
    full_size: int
    incremental_size: int

    def to_json_obj(self) -> dict[str, Any]:
        return {"trigger_ms": self.trigger_ms, "duration_ms": self.duration_ms,
                "ack_latency_ms": dict(self.ack_latency_ms), "full_size": self.full_size,
                "incremental_size": self.incremental_size}


@dataclass(frozen=True, slots=True)
class Manifest:
    """One committed checkpoint attempt (see the module docstring).

    Build with :meth:`build` (validates caller values) or :func:`decode_manifest` (validates
    stored bytes). ``referenced_keys`` is the union over all tasks.
    """

    job_id: str
    checkpoint_id: int
    attempt: int
    created_ms: int
    tasks: tuple[TaskEntry, ...]
    stats: CheckpointStats
    #: How many checkpoints the job retained when it committed this one (its coordinator's
    #: ``retained``); ``None``: not recorded (a version-1 manifest). ``dstl gc`` reads it.
    retained: int | None = None
    #: The job's own values committed with this checkpoint (version 3; empty: none).
    properties: Mapping[str, Any] = field(default_factory=dict)
    referenced_keys: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "referenced_keys",
                           frozenset(k for t in self.tasks for k in t.referenced_keys))

    @classmethod
    def build(cls, *, job_id: str, checkpoint_id: int, attempt: int, created_ms: int,
              tasks: Sequence[TaskEntry], trigger_ms: int, duration_ms: float,
              ack_latency_ms: Mapping[str, float], retained: int,
              properties: Mapping[str, Any] | None = None) -> Manifest:
        """Validate and build a manifest; the stats' sizes are the sums over ``tasks``.

        Args:
            job_id: the job (or operator) this store belongs to.
            checkpoint_id: the checkpoint (under Spark: the micro-batch id).
            attempt: 1 for the first commit of this id, then 2, 3, ...
            created_ms: wall-clock commit time, epoch ms.
            tasks: one entry per task, task ids unique, at least one.
            trigger_ms: wall-clock trigger time, epoch ms.
            duration_ms: trigger to commit.
            ack_latency_ms: per task id, trigger to acknowledgement; same task ids as ``tasks``.
            retained: the job's retention (checkpoints kept), 1..``MAX_RETAINED``.
            properties: the job's own values (module docstring: names and value types).

        Returns:
            The manifest.

        Raises:
            UsageError: a field is out of range, a task id repeats, or the latency map's task
                ids differ from the tasks'.
        """
        stats = CheckpointStats(trigger_ms, round(float(duration_ms), 3),
                                {k: round(float(v), 3) for k, v in ack_latency_ms.items()},
                                sum(t.full_size for t in tasks),
                                sum(t.incremental_size for t in tasks))
        m = cls(job_id, checkpoint_id, attempt, created_ms, tuple(tasks), stats, retained,
                dict(check_properties(properties or {}, _usage)))
        if retained is None:
            _usage("retained", "the job's retention is required (an integer >= 1)")
        _validate(m, _usage)
        return m

    @property
    def key(self) -> str:
        """This manifest's object key."""
        return manifest_key(self.checkpoint_id, self.attempt)

    def refs(self) -> CheckpointRefs:
        """The planner's view of this checkpoint."""
        return CheckpointRefs(self.checkpoint_id, self.attempt, self.referenced_keys)

    def task(self, task_id: str) -> TaskEntry:
        """The entry of ``task_id``.

        Raises:
            KeyError: no such task in this checkpoint.
        """
        for t in self.tasks:
            if t.task_id == task_id:
                return t
        raise KeyError(task_id)

    @property
    def version(self) -> int:
        """The format version this manifest encodes as: 3 with properties, else 2, or 1
        without a recorded retention."""
        if self.properties:
            return PROPERTIES_VERSION
        return 1 if self.retained is None else FORMAT_VERSION

    def to_json_obj(self) -> dict[str, Any]:
        """The body (what the CRC covers)."""
        body = {"job_id": self.job_id, "checkpoint_id": self.checkpoint_id,
                "attempt": self.attempt, "created_ms": self.created_ms,
                "tasks": [t.to_json_obj() for t in self.tasks],
                "stats": self.stats.to_json_obj()}
        if self.retained is not None:
            body["retained"] = self.retained
        if self.properties:
            body["properties"] = dict(self.properties)
        return body

    def encode(self) -> bytes:
        """See :func:`encode_manifest`."""
        return encode_manifest(self)


def _validate(m: Manifest, fail: _Fail) -> None:
    """Cross-field rules shared by :meth:`Manifest.build` and decoding."""
    _check_id(m.job_id, "job_id", fail)
    _check_int_range(m.checkpoint_id, 0, MAX_CHECKPOINT_ID, "checkpoint_id", fail)
    _check_int_range(m.attempt, 1, MAX_ATTEMPT, "attempt", fail)
    _check_int_range(m.created_ms, 0, None, "created_ms", fail)
    if m.retained is not None:
        _check_int_range(m.retained, 1, MAX_RETAINED, "retained", fail)
    if m.properties and m.retained is None:
        fail("properties", "a manifest with properties records its retention too")
    check_properties(m.properties, fail)
    if not m.tasks:
        fail("tasks", "a checkpoint has at least one task")
    ids = [t.task_id for t in m.tasks]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        fail("tasks", f"task ids repeat: {dup[:5]}")
    s = m.stats
    _check_int_range(s.trigger_ms, 0, None, "stats.trigger_ms", fail)
    _check_number(s.duration_ms, "stats.duration_ms", fail)
    if set(s.ack_latency_ms) != set(ids):
        fail("stats.ack_latency_ms", "task ids differ from the tasks' "
                                     f"({sorted(s.ack_latency_ms)[:5]} vs {sorted(ids)[:5]})")
    for tid, v in s.ack_latency_ms.items():
        _check_number(v, f"stats.ack_latency_ms[{tid!r}]", fail)
    if s.full_size != sum(t.full_size for t in m.tasks):
        fail("stats.full_size", f"{s.full_size} is not the sum of the tasks' full sizes")
    if s.incremental_size != sum(t.incremental_size for t in m.tasks):
        fail("stats.incremental_size", f"{s.incremental_size} is not the sum of the tasks' "
                                       "incremental sizes")


# --------------------------------------------------------------------------- codec


def encode_manifest(m: Manifest) -> bytes:
    """Encode ``m`` as canonical JSON with a CRC-32 over the body (module docstring)."""
    body = m.to_json_obj()
    crc = zlib.crc32(_canonical(body))
    return _canonical({"format": FORMAT_NAME, "version": m.version, "crc32": f"{crc:08x}",
                       "body": body}) + b"\n"


def decode_manifest(data: bytes, key: str, *, max_bytes: int | None = None) -> Manifest:
    """Decode and validate a stored manifest (untrusted input).

    Args:
        data: the object's bytes.
        key: the object's key; named in every error, and when it is a manifest name its
            checkpoint id and attempt must match the body's.
        max_bytes: the size limit (default :data:`MAX_MANIFEST_BYTES`).

    Returns:
        The manifest.

    Raises:
        CorruptObjectError: the bytes are not a manifest (too large, not UTF-8 or JSON, not in
            canonical form); the subclasses say more —
            :class:`~dstl.errors.UnsupportedFormatError` (other format or version),
            :class:`~dstl.errors.ChecksumMismatchError` (CRC),
            :class:`CorruptManifestError` (a field, named), :class:`UnsafeManifestKeyError` (a
            referenced key that could escape the root).
    """
    data = bytes(data)

    def fail(f: str, reason: str) -> NoReturn:
        raise CorruptManifestError(key, f, reason)

    limit = MAX_MANIFEST_BYTES if max_bytes is None else max_bytes
    if len(data) > limit:
        raise CorruptObjectError(key, 0, f"{len(data)} bytes is larger than the manifest limit "
                                         f"of {limit} bytes")
    _check_crc_unparsed(data, key)
    doc = _parse_document(data, key)
    body = _checked_body(doc, data, key, fail)
    return _decode_body(body, doc["version"], key, fail)


def _check_crc_unparsed(data: bytes, key: str) -> None:
    """The CRC (and format) from the raw bytes, before anything is parsed: a manifest in
    canonical form is the body's canonical bytes between a fixed prefix and a fixed tail."""
    tail = _TAIL.search(data, max(0, len(data) - _TAIL_SEARCH_BYTES))
    if not data.startswith(_BODY_PREFIX) or tail is None:
        if len(data) > _PARSE_UNFRAMED_BYTES:
            raise CorruptObjectError(key, 0, "not a dstl-manifest document (it does not start "
                                             "and end like one)")
        return  # small: parsed next, so the error can say what it is
    fmt, version = tail.group(2).decode("ascii", "replace"), int(tail.group(3))
    if fmt != FORMAT_NAME or version not in READ_VERSIONS:
        raise UnsupportedFormatError(key, tail.start(), f"{fmt!r:.40} v{version}", _READABLE)
    expected = int(tail.group(1), 16)
    got = zlib.crc32(memoryview(data)[len(_BODY_PREFIX):tail.start()])
    if got != expected:
        raise ChecksumMismatchError(key, len(_BODY_PREFIX), "manifest body", expected, got)


def _parse_document(data: bytes, key: str) -> dict[str, Any]:
    """Decoding steps after the raw CRC: UTF-8, JSON (bounded), format and version."""
    doc = load_json(data, key=key, what="manifest", max_bytes=len(data))
    if not isinstance(doc, dict):
        raise UnsupportedFormatError(key, 0, f"a JSON {type(doc).__name__}", _READABLE)
    version = doc.get("version")
    if doc.get("format") != FORMAT_NAME or isinstance(version, bool) \
            or version not in READ_VERSIONS:
        raise UnsupportedFormatError(key, 0, f"{doc.get('format')!r:.40} v{version!r:.20}",
                                     _READABLE)
    return doc


def _checked_body(doc: dict[str, Any], data: bytes, key: str, fail: _Fail) -> dict[str, Any]:
    """Decoding steps 5-7: the top-level fields, the CRC over the body, canonical form."""
    _check_fields(doc, _TOP_FIELDS, "", fail)
    body, crc_text = doc["body"], doc["crc32"]
    if not isinstance(crc_text, str) or re.fullmatch(r"[0-9a-f]{8}", crc_text) is None:
        fail("crc32", f"expected 8 lowercase hex digits, got {crc_text!r:.40}")
    if not isinstance(body, dict):
        fail("body", f"expected an object, got {type(body).__name__}")
    expected = int(crc_text, 16)
    try:
        got = zlib.crc32(_canonical(body))
        canonical = _canonical(doc) + b"\n"
    except (ValueError, RecursionError) as exc:
        raise CorruptObjectError(key, 0, f"manifest cannot be re-encoded: {exc!s:.200}") from exc
    if got != expected:
        raise ChecksumMismatchError(key, 0, "manifest body", expected, got)
    if canonical != data:
        raise CorruptObjectError(key, 0, "not in canonical form (altered outside the "
                                         "checksummed body?)")
    return body


def _check_fields(obj: dict[str, Any], expected: frozenset[str], where: str,
                  fail: _Fail, version: int = FORMAT_VERSION) -> None:
    missing, extra = sorted(expected - set(obj)), sorted(set(obj) - expected)
    if missing:
        fail(f"{where}{missing[0]}", "missing")
    if extra:
        fail(f"{where}{extra[0]:.80}", f"unknown field (format v{version} has only "
                                       f"{sorted(expected)})")


def _decode_body(body: dict[str, Any], version: int, key: str, fail: _Fail) -> Manifest:
    _check_fields(body, _BODY_FIELDS[version], "body.", fail, version)
    tasks_raw = body["tasks"]
    if not isinstance(tasks_raw, list):
        fail("body.tasks", f"expected a list, got {type(tasks_raw).__name__}")
    tasks = [_decode_task(t, f"body.tasks[{i}]", key, fail) for i, t in enumerate(tasks_raw)]
    stats = _decode_stats(body["stats"], fail)
    # v1 records no retention: None ("unknown"); in v2 it is required (checked by _validate)
    props = body.get("properties", {})
    if not isinstance(props, dict):
        fail("body.properties", f"expected an object, got {type(props).__name__}")
    if version >= PROPERTIES_VERSION and not props:
        fail("body.properties", "empty (a manifest without properties is version 2)")
    m = Manifest(body["job_id"], body["checkpoint_id"], body["attempt"], body["created_ms"],
                 tuple(tasks), stats, body.get("retained"), props)
    if version >= 2 and m.retained is None:
        fail("body.retained", "expected an integer, got null")
    _validate(m, lambda f, r: fail(f"body.{f}", r))
    named = parse_manifest_key(key)
    if named is not None and named != (m.checkpoint_id, m.attempt):
        fail("body.checkpoint_id", f"the body says checkpoint {m.checkpoint_id} attempt "
                                   f"{m.attempt}, the object name says {named[0]} attempt "
                                   f"{named[1]} (copied or renamed?)")
    return m


def _decode_task(t: object, where: str, key: str, fail: _Fail) -> TaskEntry:
    if not isinstance(t, dict):
        fail(where, f"expected an object, got {type(t).__name__}")
    _check_fields(t, _TASK_FIELDS, where + ".", fail)
    task_id = _check_id(t["task_id"], where + ".task_id", fail)
    if not isinstance(t["state"], dict):
        fail(where + ".state", f"expected an object, got {type(t['state']).__name__}")
    refs = t["referenced_keys"]
    if not isinstance(refs, list):
        fail(where + ".referenced_keys", f"expected a list, got {type(refs).__name__}")
    keys = tuple(_check_ref(k, f"{where}.referenced_keys[{j}]", manifest=key)
                 for j, k in enumerate(refs))
    if list(keys) != sorted(set(keys)):
        fail(where + ".referenced_keys", "keys are not sorted and unique")
    return TaskEntry(
        task_id, t["state"], keys,
        _check_int_range(t["full_size"], 0, None, where + ".full_size", fail),
        _check_int_range(t["incremental_size"], 0, None, where + ".incremental_size", fail))


def _decode_stats(stats_raw: object, fail: _Fail) -> CheckpointStats:
    if not isinstance(stats_raw, dict):
        fail("body.stats", f"expected an object, got {type(stats_raw).__name__}")
    _check_fields(stats_raw, _STATS_FIELDS, "body.stats.", fail)
    lat = stats_raw["ack_latency_ms"]
    if not isinstance(lat, dict):
        fail("body.stats.ack_latency_ms", f"expected an object, got {type(lat).__name__}")
    return CheckpointStats(
        _check_int_range(stats_raw["trigger_ms"], 0, None, "body.stats.trigger_ms", fail),
        _check_number(stats_raw["duration_ms"], "body.stats.duration_ms", fail),
        {str(k): _check_number(v, f"body.stats.ack_latency_ms[{k!r}]", fail)
         for k, v in lat.items()},
        _check_int_range(stats_raw["full_size"], 0, None, "body.stats.full_size", fail),
        _check_int_range(stats_raw["incremental_size"], 0, None, "body.stats.incremental_size",
                         fail))
