"""Changelog handles: what a persist returns and a checkpoint stores.

A :class:`ChangelogHandle` names the change sets ``[from_sqn, to_sqn)`` of one writer, each as a
:class:`ChangeSetRef` ``(segment key, offset, length)`` — enough for a ranged read of exactly that
change set. Handles travel through checkpoint manifests, which are untrusted input: ``from_json``
validates every field and every object key (:func:`dstl.stores.base.check_key`), so a handle can never
point outside the storage root. Decoding is bounded: the JSON's size (:data:`MAX_HANDLE_BYTES`)
before it is parsed and its nesting after (:func:`dstl.untrusted.load_json`); every integer has a
range (sqns and offsets below 2^63, a record's length at most a u32 frame plus its header), and
a handle's sqn range is checked against its list of references before anything is built from
it, so a 100-byte handle cannot ask for a list of 2^62 sqns. Every failure is a
:class:`~dstl.errors.MalformedHandleError` (a ``CorruptObjectError`` and a ``UsageError``) naming
where the handle was read from (``key=``), an offset and the field.

A handle may be *restricted* to part of its writer's key groups (``restrict``): after a rescale a
restored backend keeps the old logs only for the key groups it owns, so a later restore applies
each change set to each key group exactly once (``docs/guarantees.md`` G2).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Final

from dstl.errors import (
    CorruptObjectError,
    MalformedHandleError,
    UnsafeHandleKeyError,
    UnsafePathError,
    UsageError,
)
from dstl.keygroups import MAX_PARALLELISM_LIMIT, KeyGroupRange
from dstl.stores.base import check_key
from dstl.untrusted import load_json

__all__ = ["MAX_HANDLE_BYTES", "ChangeSetRef", "ChangelogHandle", "handle_int",
           "handle_key", "handle_key_groups", "parse_handle_json"]

_JSON_VERSION = 1
#: Largest handle JSON accepted (checked before parsing): a handle lists one reference of about
#: 100 bytes per change set since the last materialization.
MAX_HANDLE_BYTES: Final = 64 * 1024 * 1024
#: Sqns, offsets and sizes are below 2^63 (the segment index stores u64; nothing larger is real).
MAX_INT: Final = (1 << 63) - 1
#: A change-set record is its 8-byte header and one zstd frame of at most 2^32 - 1 bytes.
MAX_RECORD_LENGTH: Final = 8 + (1 << 32) - 1
#: Where a handle came from, when the caller does not say.
DEFAULT_WHERE: Final = "<changelog handle>"


def handle_int(v: object, key: str, field: str, low: int = 0, high: int = MAX_INT) -> int:
    """``v`` if it is an int (not a bool) in ``[low, high]``.

    Raises:
        MalformedHandleError: it is not (names ``key`` and ``field``).
    """
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise MalformedHandleError(key, 0, field, f"{v!r:.80} is not an integer in "
                                                  f"[{low}, {high}]")
    return v


def handle_key(v: object, key: str, field: str) -> str:
    """``v`` if it is a safe object key (:func:`~dstl.stores.base.check_key`).

    Raises:
        UnsafeHandleKeyError: it is not.
    """
    try:
        return check_key(v)
    except UnsafePathError as exc:
        raise UnsafeHandleKeyError(key, field, v if isinstance(v, str) else repr(v),
                                   exc.reason) from exc


def handle_key_groups(v: object, key: str, field: str) -> KeyGroupRange:
    """``v`` as a key-group range ``[start, end]``.

    Raises:
        MalformedHandleError: it is not one.
    """
    try:
        return KeyGroupRange.from_json_obj(v)
    except UsageError as exc:
        raise MalformedHandleError(key, 0, field, str(exc)) from exc


@dataclass(frozen=True, slots=True)
class ChangeSetRef:
    """Where one change set lives: a record ``[offset, offset + length)`` of segment ``key``.

    ``kg_min``/``kg_max``: the key-group range the writer recorded for the change set (as in the
    segment's index; -1 = metadata), so a ranged read, which never reads the index, can check
    the record against it. ``None`` in 6-item references (written without the range).
    """

    sqn: int
    key: str
    offset: int
    length: int
    change_count: int
    payload_bytes: int
    kg_min: int | None = None
    kg_max: int | None = None

    def __post_init__(self) -> None:
        if (self.kg_min is None) != (self.kg_max is None) or (
                self.kg_min is not None and self.kg_max is not None
                and not -1 <= self.kg_min <= self.kg_max < MAX_PARALLELISM_LIMIT):
            raise UsageError(f"change-set reference ({self.key}@{self.offset}): key-group range "
                             f"[{self.kg_min}, {self.kg_max}] is not -1 <= min <= max < "
                             f"{MAX_PARALLELISM_LIMIT}")

    def to_json_obj(self) -> list[Any]:
        out: list[Any] = [self.sqn, self.key, self.offset, self.length, self.change_count,
                          self.payload_bytes]
        if self.kg_min is not None:
            out += [self.kg_min, self.kg_max]
        return out

    @classmethod
    def from_json_obj(cls, obj: Any, *, key: str = DEFAULT_WHERE,
                      field: str = "change_sets[?]") -> ChangeSetRef:
        """A reference from its JSON list (untrusted).

        Raises:
            MalformedHandleError: not ``[sqn, key, offset, length, change_count,
                payload_bytes]`` (or that plus ``[kg_min, kg_max]``) with each in range.
            UnsafeHandleKeyError: the segment key could escape the storage root.
        """
        if not isinstance(obj, list) or len(obj) not in (6, 8):
            raise MalformedHandleError(key, 0, field, f"{obj!r:.120} is not [sqn, key, offset, "
                                                      "length, change_count, payload_bytes] or "
                                                      "that plus [kg_min, kg_max]")
        sqn, seg, offset, length, cc, pb = obj[:6]
        kgs = [handle_int(v, key, f"{field}[{6 + i}]", -1, MAX_PARALLELISM_LIMIT - 1)
               for i, v in enumerate(obj[6:])]
        if kgs and kgs[0] > kgs[1]:
            raise MalformedHandleError(key, 0, f"{field}[6]", f"key-group range [{kgs[0]}, "
                                                              f"{kgs[1]}] is inverted")
        return cls(handle_int(sqn, key, f"{field}[0]"), handle_key(seg, key, f"{field}[1]"),
                   handle_int(offset, key, f"{field}[2]"),
                   handle_int(length, key, f"{field}[3]", 8, MAX_RECORD_LENGTH),
                   handle_int(cc, key, f"{field}[4]", 0, (1 << 32) - 1),
                   handle_int(pb, key, f"{field}[5]"), *kgs)


@dataclass(frozen=True, slots=True)
class ChangelogHandle:
    """The change sets ``[from_sqn, to_sqn)`` of writer ``log_id``.

    Attributes:
        log_id: the writer.
        key_groups: the writer's key-group range (every change of the log lies in it, or is
            metadata).
        from_sqn, to_sqn: the half-open sqn range; ``change_sets`` has one ref per sqn in it.
        change_sets: refs in sqn order.
        incremental_size: payload bytes uploaded for the persist that produced this handle (the
            rest were uploaded earlier and reused) — Flink's ``incrementalSize``.
        restrict: ``None``, or the non-empty part of ``key_groups`` this handle stands for (a
            restored backend's share of an older log); other key groups of the log are not
            part of it. Normalized: never equal to ``key_groups``.
    """

    log_id: str
    key_groups: KeyGroupRange
    from_sqn: int
    to_sqn: int
    change_sets: tuple[ChangeSetRef, ...]
    incremental_size: int = 0
    restrict: KeyGroupRange | None = None

    def __post_init__(self) -> None:
        if self.to_sqn < self.from_sqn:
            raise UsageError(f"handle range [{self.from_sqn}, {self.to_sqn}) is inverted")
        # The count first: a range of 2^62 sqns must not be materialized to be compared.
        if len(self.change_sets) != self.to_sqn - self.from_sqn or any(
                r.sqn != self.from_sqn + i for i, r in enumerate(self.change_sets)):
            sqns = [r.sqn for r in self.change_sets[:8]]
            raise UsageError(f"handle for {self.log_id!r} lists {len(self.change_sets)} sqns "
                             f"({sqns}...) which are not exactly [{self.from_sqn}, "
                             f"{self.to_sqn})")
        r = self.restrict
        if r is not None:
            if not len(r) or r.intersection(self.key_groups) != r:
                raise UsageError(f"handle for {self.log_id!r}: restrict={r} must be a non-empty "
                                 f"part of the writer's key groups {self.key_groups}")
            if r == self.key_groups:
                object.__setattr__(self, "restrict", None)

    @property
    def replay_key_groups(self) -> KeyGroupRange:
        """The key groups this handle stands for: ``restrict``, else the writer's range."""
        return self.key_groups if self.restrict is None else self.restrict

    def restricted(self, key_groups: KeyGroupRange) -> ChangelogHandle | None:
        """This handle for the key groups it shares with ``key_groups`` only; ``None`` when it
        shares none, ``self`` when it stands for none other."""
        r = self.replay_key_groups.intersection(key_groups)
        if not len(r):
            return None
        return self if r == self.replay_key_groups else replace(self, restrict=r)

    @property
    def size(self) -> int:
        """Payload bytes of all change sets (Flink's ``size``)."""
        return sum(r.payload_bytes for r in self.change_sets)

    @property
    def stored_bytes(self) -> int:
        """Bytes the change sets occupy in segments (compressed records)."""
        return sum(r.length for r in self.change_sets)

    def segment_keys(self) -> list[str]:
        """Distinct segment keys, in first-use order."""
        return list(dict.fromkeys(r.key for r in self.change_sets))

    def __iter__(self) -> Iterator[ChangeSetRef]:
        return iter(self.change_sets)

    def __len__(self) -> int:
        return len(self.change_sets)

    def to_json_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "v": _JSON_VERSION,
            "log_id": self.log_id,
            "key_groups": self.key_groups.to_json_obj(),
            "from": self.from_sqn,
            "to": self.to_sqn,
            "incremental_size": self.incremental_size,
            "change_sets": [r.to_json_obj() for r in self.change_sets],
        }
        if self.restrict is not None:  # absent in handles of unrestricted logs (and older ones)
            obj["restrict"] = self.restrict.to_json_obj()
        return obj

    def to_json(self) -> str:
        """Serialize as compact JSON."""
        return json.dumps(self.to_json_obj(), separators=(",", ":"))

    @classmethod
    def from_json_obj(cls, obj: Any, *, key: str = DEFAULT_WHERE,
                      field: str = "") -> ChangelogHandle:
        """A handle from its decoded JSON (untrusted).

        Args:
            obj: the decoded JSON.
            key: where it was read from (named in errors).
            field: its path in an enclosing document (for errors).

        Raises:
            MalformedHandleError: a field is missing, has the wrong type or range, or the
                references do not match the sqn range.
            UnsafeHandleKeyError: a segment key could escape the storage root.
        """
        at = f"{field}." if field else ""
        if not isinstance(obj, dict):
            raise MalformedHandleError(key, 0, field or "<handle>", f"expected an object, got "
                                                                    f"{type(obj).__name__}")
        if obj.get("v") != _JSON_VERSION or isinstance(obj.get("v"), bool):
            raise MalformedHandleError(key, 0, at + "v", f"changelog handle version "
                                                         f"{obj.get('v')!r:.40} is not supported "
                                                         f"(expected {_JSON_VERSION})")
        for name in ("log_id", "key_groups", "from", "to", "change_sets"):
            if name not in obj:
                raise MalformedHandleError(key, 0, at + name, "missing")
        log_id = obj["log_id"]
        if not isinstance(log_id, str) or not log_id or len(log_id) > 1024:
            raise MalformedHandleError(key, 0, at + "log_id", f"{log_id!r:.80} is not a "
                                                              "non-empty string")
        kgr = handle_key_groups(obj["key_groups"], key, at + "key_groups")
        from_sqn = handle_int(obj["from"], key, at + "from")
        to_sqn = handle_int(obj["to"], key, at + "to")
        inc = handle_int(obj.get("incremental_size", 0), key, at + "incremental_size")
        raw = obj["change_sets"]
        if not isinstance(raw, list):
            raise MalformedHandleError(key, 0, at + "change_sets", "not a list")
        if to_sqn < from_sqn or len(raw) != to_sqn - from_sqn:
            raise MalformedHandleError(key, 0, at + "change_sets",
                                       f"{len(raw)} references for the sqn range "
                                       f"[{from_sqn}, {to_sqn})")
        refs = tuple(ChangeSetRef.from_json_obj(r, key=key, field=f"{at}change_sets[{i}]")
                     for i, r in enumerate(raw))
        restrict = None
        if obj.get("restrict") is not None:
            restrict = handle_key_groups(obj["restrict"], key, at + "restrict")
            if not len(restrict) or restrict.intersection(kgr) != restrict:
                raise MalformedHandleError(key, 0, at + "restrict",
                                           f"{restrict} is not a non-empty part of the writer's "
                                           f"key groups "
                                           f"{kgr}")
        try:
            return cls(log_id, kgr, from_sqn, to_sqn, refs, inc, restrict)
        except UsageError as exc:
            raise MalformedHandleError(key, 0, at + "change_sets", str(exc)) from exc

    @classmethod
    def from_json(cls, s: str | bytes, *, key: str = DEFAULT_WHERE) -> ChangelogHandle:
        """Parse and validate a handle (untrusted input).

        Raises:
            MalformedHandleError: malformed, too large or too deeply nested JSON, or fields
                (also a :class:`~dstl.errors.UsageError`).
            UnsafeHandleKeyError: an object key would escape the storage root (also an
                :class:`~dstl.errors.UnsafePathError`).
        """
        return cls.from_json_obj(parse_handle_json(s, key), key=key)


def parse_handle_json(s: object, key: str) -> Any:
    """Decode a handle's JSON text (bounded: :func:`dstl.untrusted.load_json`).

    Raises:
        MalformedHandleError: not text, too large, not JSON, or too deep.
    """
    if not isinstance(s, (str, bytes, bytearray)):
        raise MalformedHandleError(key, 0, "<handle>", f"expected JSON text, got "
                                                       f"{type(s).__name__}")
    try:
        return load_json(s, key=key, what="handle", max_bytes=MAX_HANDLE_BYTES)
    except CorruptObjectError as exc:
        raise MalformedHandleError(key, exc.offset, "<handle>", exc.reason) from exc
