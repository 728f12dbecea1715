"""``ChangelogStateBackendHandle``: what one backend contributes to a checkpoint.

= the materialized snapshot objects (usually one; several after a rescaling restore) + the
changelog handles after them (the restored non-materialized handles, kept until the first
materialization after a restore, then this checkpoint's delta). It travels through manifests
(untrusted input): ``from_json`` validates every field and every object key, bounded like a
changelog handle (:mod:`dstl.handle`): :class:`~dstl.errors.MalformedHandleError` naming where
the handle was read from and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from dstl.errors import MalformedHandleError
from dstl.handle import (
    ChangelogHandle,
    handle_int,
    handle_key,
    handle_key_groups,
    parse_handle_json,
)
from dstl.keygroups import MAX_PARALLELISM_LIMIT, KeyGroupRange

__all__ = ["ChangelogStateBackendHandle", "SnapshotRef"]

#: Where a backend handle came from, when the caller does not say.
_WHERE = "<backend handle>"


def _int(obj: dict[str, Any], name: str, key: str, field: str, minimum: int = 0,
         maximum: int = (1 << 63) - 1) -> int:
    if name not in obj:
        raise MalformedHandleError(key, 0, field + name, "missing")
    return handle_int(obj[name], key, field + name, minimum, maximum)


@dataclass(frozen=True, slots=True)
class SnapshotRef:
    """A materialized snapshot object.

    Attributes:
        key: the object.
        size: its bytes.
        key_groups: the key groups this reference stands for: the snapshot's own range, or the
            part of it a restored backend owns (:meth:`restricted`).
        materialization_id: the materialization that wrote it.
        delta: the object is a delta (format v3, :mod:`materializer.delta_format`): the
            changes since the previous piece of the same key groups, applied on top of it; a
            full snapshot (v1 or v2) otherwise.
    """

    key: str
    size: int
    key_groups: KeyGroupRange
    materialization_id: int
    delta: bool = False

    def restricted(self, key_groups: KeyGroupRange) -> SnapshotRef | None:
        """This reference for the key groups it shares with ``key_groups`` only (``None``:
        none)."""
        r = self.key_groups.intersection(key_groups)
        if not len(r):
            return None
        return self if r == self.key_groups else replace(self, key_groups=r)

    def to_json_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"key": self.key, "size": self.size,
                               "key_groups": self.key_groups.to_json_obj(),
                               "materialization_id": self.materialization_id}
        if self.delta:
            obj["delta"] = True
        return obj

    @classmethod
    def from_json_obj(cls, obj: Any, *, key: str = _WHERE,
                      field: str = "materialized[?]") -> SnapshotRef:
        """A snapshot reference from its decoded JSON (untrusted).

        Raises:
            MalformedHandleError: a field is missing or out of range.
            UnsafeHandleKeyError: the object key could escape the storage root.
        """
        if not isinstance(obj, dict):
            raise MalformedHandleError(key, 0, field, f"{obj!r:.80} is not an object")
        at = field + "."
        delta = obj.get("delta", False)
        if type(delta) is not bool:
            raise MalformedHandleError(key, 0, at + "delta", f"{delta!r:.80} is not a boolean")
        return cls(handle_key(obj.get("key"), key, at + "key"), _int(obj, "size", key, at),
                   handle_key_groups(obj.get("key_groups"), key, at + "key_groups"),
                   _int(obj, "materialization_id", key, at), delta)


@dataclass(frozen=True, slots=True)
class ChangelogStateBackendHandle:
    """One backend's part of a checkpoint.

    Attributes:
        operator_id: the backend's operator id (also its log id).
        key_groups: its key-group range.
        checkpoint_id: the checkpoint.
        materialization_id: id of the newest materialization in ``materialized``.
        materialized: snapshot objects.
        non_materialized: changelog handles to replay after the snapshots, in order.
        incremental_size: bytes newly uploaded for this checkpoint.
        max_parallelism: the job's number of key groups (a restore needs it).
    """

    operator_id: str
    key_groups: KeyGroupRange
    checkpoint_id: int
    materialization_id: int
    materialized: tuple[SnapshotRef, ...]
    non_materialized: tuple[ChangelogHandle, ...]
    incremental_size: int
    max_parallelism: int = 128

    @property
    def materialized_size(self) -> int:
        """Bytes of the snapshot objects (each once, however many ranges name it)."""
        return sum({s.key: s.size for s in self.materialized}.values())

    @property
    def non_materialized_size(self) -> int:
        """Stored bytes of the change sets (each once, however many ranges name it)."""
        return sum({(r.key, r.offset): r.length for h in self.non_materialized
                    for r in h.change_sets}.values())

    @property
    def full_size(self) -> int:
        """Bytes a restore reads (snapshots + log records)."""
        return self.materialized_size + self.non_materialized_size

    def referenced_keys(self) -> list[str]:
        """Every object this handle needs (for the coordinator's registry)."""
        keys = [s.key for s in self.materialized]
        for h in self.non_materialized:
            keys.extend(h.segment_keys())
        return list(dict.fromkeys(keys))

    def to_json_obj(self) -> dict[str, Any]:
        return {"v": 1, "operator_id": self.operator_id,
                "key_groups": self.key_groups.to_json_obj(),
                "checkpoint_id": self.checkpoint_id,
                "materialization_id": self.materialization_id,
                "materialized": [s.to_json_obj() for s in self.materialized],
                "non_materialized": [h.to_json_obj() for h in self.non_materialized],
                "incremental_size": self.incremental_size,
                "max_parallelism": self.max_parallelism}

    def to_json(self) -> str:
        return json.dumps(self.to_json_obj(), separators=(",", ":"))

    @classmethod
    def from_json_obj(cls, obj: Any, *, key: str = _WHERE) -> ChangelogStateBackendHandle:
        """A backend handle from its decoded JSON (untrusted).

        Raises:
            MalformedHandleError: a field is missing or has the wrong type or range.
            UnsafeHandleKeyError: an object key could escape the storage root.
        """
        if not isinstance(obj, dict) or obj.get("v") != 1 or isinstance(obj.get("v"), bool):
            raise MalformedHandleError(key, 0, "v", "expected an object with v=1")
        op = obj.get("operator_id")
        if not isinstance(op, str) or not op or len(op) > 1024:
            raise MalformedHandleError(key, 0, "operator_id", f"{op!r:.80} is not a non-empty "
                                                              "string")
        mats = obj.get("materialized")
        nons = obj.get("non_materialized")
        if not isinstance(mats, list) or not isinstance(nons, list):
            raise MalformedHandleError(key, 0, "materialized",
                                       "materialized and non_materialized must be lists")
        return cls(op, handle_key_groups(obj.get("key_groups"), key, "key_groups"),
                   _int(obj, "checkpoint_id", key, "", -1), _int(obj, "materialization_id", key, ""),
                   tuple(SnapshotRef.from_json_obj(m, key=key, field=f"materialized[{i}]")
                         for i, m in enumerate(mats)),
                   tuple(ChangelogHandle.from_json_obj(h, key=key, field=f"non_materialized[{i}]")
                         for i, h in enumerate(nons)),
                   _int(obj, "incremental_size", key, ""),
                   _int(obj, "max_parallelism", key, "", 1, MAX_PARALLELISM_LIMIT))

    @classmethod
    def from_json(cls, s: str | bytes, *, key: str = _WHERE) -> ChangelogStateBackendHandle:
        """Parse and validate (untrusted input; bounded, see :mod:`dstl.handle`).

        Raises:
            MalformedHandleError: malformed JSON or fields (also a ``UsageError``).
            UnsafeHandleKeyError: an object key would escape the storage root.
        """
        return cls.from_json_obj(parse_handle_json(s, key), key=key)
