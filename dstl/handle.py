"""Changelog handles: what a persist returns and a checkpoint stores.

A :class:`ChangelogHandle` names the change sets ``[from_sqn, to_sqn)`` of one writer, each as a
:class:`ChangeSetRef` ``(segment key, offset, length)`` — enough for a ranged read of exactly that
change set. Handles travel through checkpoint manifests, which are untrusted input: ``from_json``
validates every field and every object key (:func:`dstl.stores.base.check_key`), so a handle can never
point outside the storage root.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dstl.errors import UsageError
from dstl.keygroups import KeyGroupRange
from dstl.stores.base import check_key

__all__ = ["ChangeSetRef", "ChangelogHandle"]

_JSON_VERSION = 1


@dataclass(frozen=True, slots=True)
class ChangeSetRef:
    """Where one change set lives: a record ``[offset, offset + length)`` of segment ``key``."""

    sqn: int
    key: str
    offset: int
    length: int
    change_count: int
    payload_bytes: int

    def to_json_obj(self) -> list[Any]:
        return [self.sqn, self.key, self.offset, self.length, self.change_count,
                self.payload_bytes]

    @classmethod
    def from_json_obj(cls, obj: Any) -> ChangeSetRef:
        if not isinstance(obj, list) or len(obj) != 6:
            raise UsageError(f"malformed change-set reference {obj!r}: expected "
                             "[sqn, key, offset, length, change_count, payload_bytes]")
        sqn, key, offset, length, cc, pb = obj
        for name, v in (("sqn", sqn), ("offset", offset), ("length", length),
                        ("change_count", cc), ("payload_bytes", pb)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UsageError(f"malformed change-set reference: {name}={v!r} is not a "
                                 "non-negative int")
        return cls(sqn, check_key(key), offset, length, cc, pb)


@dataclass(frozen=True, slots=True)
class ChangelogHandle:
    """The change sets ``[from_sqn, to_sqn)`` of writer ``log_id``.

    Attributes:
        log_id: the writer.
        key_groups: the writer's key-group range.
        from_sqn, to_sqn: the half-open sqn range; ``change_sets`` has one ref per sqn in it.
        change_sets: refs in sqn order.
        incremental_size: payload bytes uploaded for the persist that produced this handle (the
            rest were uploaded earlier and reused) — Flink's ``incrementalSize``.
    """

    log_id: str
    key_groups: KeyGroupRange
    from_sqn: int
    to_sqn: int
    change_sets: tuple[ChangeSetRef, ...]
    incremental_size: int = 0

    def __post_init__(self) -> None:
        if self.to_sqn < self.from_sqn:
            raise UsageError(f"handle range [{self.from_sqn}, {self.to_sqn}) is inverted")
        sqns = [r.sqn for r in self.change_sets]
        if sqns != list(range(self.from_sqn, self.to_sqn)):
            raise UsageError(f"handle for {self.log_id!r} lists sqns {sqns[:8]}... which are not "
                             f"exactly [{self.from_sqn}, {self.to_sqn})")

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
        return {
            "v": _JSON_VERSION,
            "log_id": self.log_id,
            "key_groups": self.key_groups.to_json_obj(),
            "from": self.from_sqn,
            "to": self.to_sqn,
            "incremental_size": self.incremental_size,
            "change_sets": [r.to_json_obj() for r in self.change_sets],
        }

    def to_json(self) -> str:
        """Serialize as compact JSON."""
        return json.dumps(self.to_json_obj(), separators=(",", ":"))

    @classmethod
    def from_json_obj(cls, obj: Any) -> ChangelogHandle:
        if not isinstance(obj, dict):
            raise UsageError(f"malformed changelog handle: expected an object, got "
                             f"{type(obj).__name__}")
        if obj.get("v") != _JSON_VERSION:
            raise UsageError(f"changelog handle version {obj.get('v')!r} is not supported "
                             f"(expected {_JSON_VERSION})")
        try:
            log_id = obj["log_id"]
            kgr = KeyGroupRange.from_json_obj(obj["key_groups"])
            from_sqn, to_sqn = obj["from"], obj["to"]
            inc = obj.get("incremental_size", 0)
            refs = obj["change_sets"]
        except KeyError as exc:
            raise UsageError(f"malformed changelog handle: missing field {exc}") from exc
        if not isinstance(log_id, str) or not log_id:
            raise UsageError(f"malformed changelog handle: log_id={log_id!r}")
        for name, v in (("from", from_sqn), ("to", to_sqn), ("incremental_size", inc)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UsageError(f"malformed changelog handle: {name}={v!r}")
        if not isinstance(refs, list):
            raise UsageError("malformed changelog handle: change_sets is not a list")
        return cls(log_id, kgr, from_sqn, to_sqn,
                   tuple(ChangeSetRef.from_json_obj(r) for r in refs), inc)

    @classmethod
    def from_json(cls, s: str | bytes) -> ChangelogHandle:
        """Parse and validate a handle (untrusted input).

        Raises:
            UsageError: malformed JSON or fields.
            UnsafePathError: an object key would escape the storage root.
        """
        try:
            obj = json.loads(s)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"changelog handle is not valid JSON: {exc}") from exc
        return cls.from_json_obj(obj)
